"""One bundle writer for both front-ends: state table, programs, manifest, file, report.

A front-end traces the recipe its own way (torch_xla's lazy graph, or torch's aten graph
lowered through jax) and hands this module what it found: every state tensor with its
initial value, each entry's programs as binding tables plus a way to lower them, the
declared hyperparameters' values and the RNG record. ``write_bundle`` decides which
state is in the bundle (gradients only where a program reads or writes them), what each
state section holds (``initial_state.py``), names the sections, builds the manifest and
writes the bundle atomically, and says what it did in an ``ExportReport``.

Imports: torch, stepbundle.schema (no torch_xla, no jax but its version string).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

import stepbundle.schema as codec
from stepbundle._version import __version__
from stepbundle.schema.manifest import (
    ConstantInput,
    Entry,
    Hyperparameter,
    InputBinding,
    InputKind,
    Manifest,
    NamedSpec,
    OutputBinding,
    Producer,
    Program,
    Rng,
    SectionKind,
    StateEntry,
    StateInput,
    StateKind,
    StateUpdateOutput,
)

from .dtypes import HYPERPARAMETER_DTYPE, spec_of, tensor_bytes
from .errors import ExportError
from .initial_state import initial_section, non_persistent_buffers
from .recipe import Recipe

if TYPE_CHECKING:
    from .step_check import CheckReport

__all__ = [
    "ExportReport",
    "Lowered",
    "ProgramDraft",
    "StateRecord",
    "producer",
    "write_bundle",
]


@dataclass
class ExportReport:
    """What an export did, for the CLI and for people reading logs (both front-ends).

    Attributes:
      path: the bundle written.
      manifest: its manifest.
      digest: the bundle digest ("sha256:...").
      size: the file size in bytes.
      stage_seconds: wall time of each stage ("trace", "lower", "write").
      input_counts: number of graph inputs of each kind, over the train programs.
      numerics_rewrites: ops the torch_xla front-end rewrote for ``Recipe.numerics`` over
        all programs (training BatchNorm's ``batch_norm_training`` / ``batch_norm_grad``);
        0 with ``numerics="torch_xla"``, when the step has none, and always with the torch
        front-end (its programs are PyTorch's numerics as traced).
      notes: what the user should know about the bundle written (optimizer settings a
        scheduler set and the bundle keeps fixed, ``schedulers.py``); each is also given
        to ``progress`` and issued as a ``UserWarning``.
      check: what the export check did (``step_check.CheckReport``), or None when it
        was not asked for (``check=False``).
    """

    path: Path
    manifest: Manifest
    digest: str
    size: int
    stage_seconds: dict[str, float] = field(default_factory=dict)
    input_counts: dict[str, int] = field(default_factory=dict)
    numerics_rewrites: int = 0
    notes: list[str] = field(default_factory=list)
    check: CheckReport | None = None

    def __repr__(self) -> str:
        """What was written, where, and how big, on one line: the manifest (every table
        of the bundle) and the stage and check timings stay attributes."""
        state = self.manifest.state
        if self.check is None:
            check = "not asked"
        elif self.check.ran:
            check = f"{self.check.compared} compared, agree"
        else:
            check = "skipped"
        return (
            f"ExportReport(path={str(self.path)!r}, size={self.size}, digest={self.digest!r}, "
            f"entries={tuple(self.manifest.entries)!r}, state={len(state)} tensors of "
            f"{sum(s.spec.nbytes for s in state)} bytes, notes={len(self.notes)}, "
            f"check={check!r})"
        )


class StateRecord(Protocol):
    """What the writer reads of a front-end's state tensor record (``StateTensor`` of the
    torch_xla front-end, ``Slot`` of the torch front-end)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> StateKind: ...
    @property
    def trainable(self) -> bool: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class Lowered:
    """A program as the bundle stores it.

    Attributes:
      artifact: the StableHLO portable artifact.
      target: the StableHLO version it was serialized for.
      text: the program as MLIR text (written with ``mlir_dir``).
      rewrites: ops rewritten for ``Recipe.numerics`` (``ExportReport.numerics_rewrites``).
    """

    artifact: bytes
    target: str
    text: str
    rewrites: int = 0


@dataclass(frozen=True)
class ProgramDraft:
    """One shape bucket's program of an entry, before its sections are named.

    Attributes:
      inputs, outputs: the binding tables.
      batch: the shape bucket's batch signature.
      lower: makes the artifact; called once, with the program's description for
        messages ("train program 0").
      constants: the value of each ``ConstantInput``, by the input's name.
      eval_modules: the modules the step ran in eval mode (``Entry.eval_modules``).
    """

    inputs: tuple[InputBinding, ...]
    outputs: tuple[OutputBinding, ...]
    batch: tuple[NamedSpec, ...]
    lower: Callable[[str], Lowered]
    constants: Mapping[str, torch.Tensor] = field(default_factory=dict)
    eval_modules: tuple[str, ...] = ()


def producer(torch_xla: str) -> Producer:
    """The producer record: this stepbundle, torch and jax, and ``torch_xla`` as given
    (its version, or a note that none was involved)."""
    import jax

    return Producer(
        stepbundle=__version__,
        torch=str(torch.__version__),
        torch_xla=torch_xla,
        jax=str(jax.__version__),
    )


def _state_table(
    recipe: Recipe,
    state: Sequence[tuple[StateRecord, torch.Tensor]],
    entries: Mapping[str, Sequence[ProgramDraft]],
) -> tuple[list[StateEntry], list[codec.SectionPayload]]:
    referenced: set[str] = set()
    for progs in entries.values():
        for p in progs:
            referenced |= {i.name for i in p.inputs if isinstance(i, StateInput)}
            referenced |= {o.state for o in p.outputs if isinstance(o, StateUpdateOutput)}
    rows: list[StateEntry] = []
    payloads: list[codec.SectionPayload] = []
    non_persistent = non_persistent_buffers(recipe.model)
    for s, value in state:
        # Gradients are state only when the step keeps or reads them.
        if s.kind is StateKind.GRADIENT and s.name not in referenced:
            continue
        section = f"state/{s.name}"
        rows.append(
            StateEntry(
                name=s.name,
                kind=s.kind,
                spec=spec_of(value.dtype, tuple(value.shape), f"State {s.name!r}"),
                section=section,
                trainable=s.trainable,
                aliases=s.aliases,
            )
        )
        kind, data = initial_section(
            s, value, include_state=recipe.include_state, non_persistent=non_persistent
        )
        payloads.append(codec.SectionPayload(section, kind, data))
    return rows, payloads


def write_bundle(
    recipe: Recipe,
    path: str | os.PathLike[str],
    *,
    state: Sequence[tuple[StateRecord, torch.Tensor]],
    entries: Mapping[str, Sequence[ProgramDraft]],
    hyperparameters: Mapping[str, float],
    producer: Producer,
    rng: Callable[[], tuple[Rng, tuple[str, ...]]],
    metadata: Mapping[str, str],
    numerics: str,
    matmul_precision: str,
    notes: Sequence[str] = (),
    mlir_dir: str | os.PathLike[str] | None = None,
    say: Callable[[str], None] = lambda _msg: None,
    times: dict[str, float] | None = None,
) -> ExportReport:
    """Lower every program, build the manifest and write the bundle to ``path``.

    Args:
      recipe: the recipe exported (its model, for non-persistent buffers, and
        ``include_state``).
      state: every state tensor the front-end found, in the bundle's order, with its
        initial value (a CPU tensor).
      entries: each entry's programs, one per shape bucket; ``"train"`` updates state,
        every other entry is read-only.
      hyperparameters: each declared hyperparameter's initial value, by bundle name.
      producer: the producer record (``producer()``).
      rng: called only when a program takes the RNG seed: the manifest's RNG record and
        the features it requires.
      metadata, numerics, matmul_precision: the manifest's fields, checked already.
      notes: what the user should know (``ExportReport.notes``).
      mlir_dir: if given, each program is also written there as ``.mlir`` text.
      say: called with a line per stage.
      times: stage times so far; "lower" and "write" are added.

    Raises:
      ExportError: a program could not be lowered (the front-end's ``lower`` says why).
    """
    times = {} if times is None else times
    t0 = time.perf_counter()
    state_entries, payloads = _state_table(recipe, state, entries)
    known = {e.name for e in state_entries}
    by_rule = {SectionKind.FILL, SectionKind.EXTERNAL} & {p.kind for p in payloads}
    uses_seed = False
    rewrites = 0
    manifest_entries: dict[str, Entry] = {}
    texts: dict[str, str] = {}
    for entry_name, progs in entries.items():
        programs = []
        for i, draft in enumerate(progs):
            what = f"{entry_name} program {i}"
            for inp in draft.inputs:
                if isinstance(inp, StateInput) and inp.name not in known:  # pragma: no cover
                    raise ExportError(f"Internal error: {what} reads unknown state {inp.name!r}.")
                uses_seed |= inp.kind is InputKind.RNG_SEED
            lowered = draft.lower(what)
            rewrites += lowered.rewrites
            section = f"program/{entry_name}/{i}"
            payloads.append(codec.SectionPayload(section, SectionKind.PROGRAM, lowered.artifact))
            for inp in draft.inputs:
                if isinstance(inp, ConstantInput):
                    data = tensor_bytes(draft.constants[inp.name])
                    payloads.append(codec.SectionPayload(inp.section, SectionKind.TENSOR, data))
            texts[f"{entry_name}.{i}"] = lowered.text
            programs.append(
                Program(
                    section=section,
                    stablehlo_version=lowered.target,
                    inputs=draft.inputs,
                    outputs=draft.outputs,
                    batch=draft.batch,
                )
            )
        manifest_entries[entry_name] = Entry(
            programs=tuple(programs),
            updates_state=entry_name == "train",
            eval_modules=progs[0].eval_modules,
        )
    hypers = tuple(
        Hyperparameter(
            name=n, spec=spec_of(HYPERPARAMETER_DTYPE, (), f"Hyperparameter {n!r}"), value=v
        )
        for n, v in hyperparameters.items()
    )
    rng_record, rng_features = rng() if uses_seed else (None, ())
    manifest = Manifest(
        producer=producer,
        entries=manifest_entries,
        state=tuple(state_entries),
        hyperparameters=hypers,
        rng=rng_record,
        sections=(),
        metadata=dict(metadata),
        required_features=((codec.STATE_INITIALIZERS,) if by_rule else ()) + rng_features,
        numerics=numerics,
        matmul_precision=matmul_precision,
    )
    times["lower"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    bundle_path = Path(path)
    manifest = codec.write_bundle(bundle_path, manifest, payloads)
    if mlir_dir is not None:
        d = Path(mlir_dir)
        d.mkdir(parents=True, exist_ok=True)
        for key, text in texts.items():
            codec.atomic_write(d / f"{bundle_path.name}.{key}.mlir", [text.encode("utf-8")])
    times["write"] = time.perf_counter() - t1
    with codec.open_bundle(bundle_path) as b:
        digest, size = b.digest, b.file_size
    counts: dict[str, int] = {}
    for prog in manifest.entries["train"].programs:
        for inp in prog.inputs:
            counts[inp.kind.value] = counts.get(inp.kind.value, 0) + 1
    say(f"wrote {bundle_path} ({size / 1e6:.2f} MB, {digest})")
    for note in notes:
        say(f"note: {note}")
        warnings.warn(note, UserWarning, stacklevel=3)
    return ExportReport(bundle_path, manifest, digest, size, times, counts, rewrites, list(notes))
