"""``export(recipe, path)``: capture a training step with torch alone and write a bundle.

Stages: list the recipe's state (``state.py``); capture each shape bucket's training
step twice and each read-only entry twice (``capture.py``); prove the two captures are
one program and build its binding tables (``bind.py``); lower each program to StableHLO
through jax (``lowering.py``); write the bundle (``stepbundle.schema``), in the format
the torch_xla front-end writes, for the same runtime.

Imports: torch, jax, stepbundle.schema, stepbundle.stablehlo, stepbundle.exporter's
torch_xla-free modules (recipe, errors, dtypes).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import stepbundle.schema as codec
from stepbundle import __version__
from stepbundle.exporter.dtypes import HYPERPARAMETER_DTYPE, spec_of
from stepbundle.exporter.errors import ExportError
from stepbundle.exporter.hyperparameters import place_of
from stepbundle.exporter.initial_state import initial_section, non_persistent_buffers
from stepbundle.exporter.recipe import Recipe, checked_metadata
from stepbundle.exporter.schedulers import scheduler_notes
from stepbundle.schema.manifest import (
    Entry,
    Hyperparameter,
    InputKind,
    Manifest,
    NamedSpec,
    Producer,
    Program,
    Rng,
    SectionKind,
    StateEntry,
    StateInput,
    StateKind,
    StateUpdateOutput,
)
from stepbundle.stablehlo import artifact as mlir

from .bind import BoundProgram, bind
from .capture import Capture, Hyper, capture
from .lowering import LoweringError, UnsupportedOperator, lower
from .state import Sandbox, Slot, state_slots

__all__ = ["FRONTEND", "NO_TORCH_XLA", "ExportReport", "export"]

FRONTEND = "stepbundle.export_torch"
"""The name this front-end gives itself in a bundle's producer record."""

NO_TORCH_XLA = f"none (front-end {FRONTEND})"
"""``Producer.torch_xla`` of a bundle this front-end wrote: no torch_xla was involved."""


@dataclass
class ExportReport:
    """What an export did (the torch_xla front-end's report, field for field).

    Attributes:
      path: the bundle written; manifest: its manifest; digest: "sha256:..."; size: bytes.
      stage_seconds: wall time of each stage.
      input_counts: number of graph inputs of each kind, over the train programs.
      notes: optimizer settings a scheduler set that the bundle keeps fixed
        (``stepbundle.exporter.schedulers``), also given to ``progress`` and warned.
    """

    path: Path
    manifest: Manifest
    digest: str
    size: int
    stage_seconds: dict[str, float] = field(default_factory=dict)
    input_counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# torch.get_float32_matmul_precision() as StableHLO's precision_config: "highest" (PyTorch's
# default) is full float32, "high" allows TF32 or bf16x3, "medium" bf16 passes.
_TORCH_MATMUL_PRECISION: dict[str, str] = {
    "highest": "highest",
    "high": "high",
    "medium": "default",
}


def _producer() -> Producer:
    import jax

    return Producer(
        stepbundle=__version__, torch=str(torch.__version__), torch_xla=NO_TORCH_XLA,
        jax=str(jax.__version__),
    )  # fmt: skip


def _batch(batch: Mapping[str, torch.Tensor], which: str) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in batch.items():
        if not isinstance(k, str) or not k:
            raise ExportError(f"The {which} has a key {k!r}; batch keys must be non-empty strings.")
        if not isinstance(v, torch.Tensor):
            raise ExportError(
                f"The {which} maps {k!r} to {type(v).__name__}; every batch value must be a "
                "tensor (the runtime feeds arrays)."
            )
        spec_of(v.dtype, tuple(v.shape), f"Batch input {k!r}")
        out[k] = v.detach().cpu()
    return out


def _hyperparameters(recipe: Recipe) -> list[Hyper]:
    groups = recipe.optimizer.param_groups
    out = []
    for key in recipe.hyperparameters:
        for i, group in enumerate(groups):
            # A key ("lr") or an element of a tuple one ("betas.0"), as for torch_xla.
            base, index = place_of(recipe.optimizer, key, group, i)
            value = group[base] if index is None else group[base][index]
            if isinstance(value, torch.Tensor):
                value = float(value.detach().cpu())
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ExportError(
                    f"Hyperparameter {key!r} of param_groups[{i}] is {value!r}; only real "
                    "scalars can be exported as hyperparameters"
                    + (". Declare a tuple's elements one by one: "
                       + ", ".join(repr(f"{key}.{j}") for j in range(len(value))) + "."
                       if isinstance(value, (tuple, list)) else ".")
                )  # fmt: skip
            name = key if len(groups) == 1 else f"param_groups.{i}.{key}"
            # The value the program input holds (float32), as the torch_xla front-end
            # records it.
            held = float(torch.tensor(float(value), dtype=HYPERPARAMETER_DTYPE))
            out.append(Hyper(name, i, base, held, index))
    return out


class _GradientsDropped(Exception):
    """The step sets gradients to None: trace again without materialized gradients."""


_Bound = list[tuple[BoundProgram, tuple[NamedSpec, ...]]]


def _signature(batch: Mapping[str, torch.Tensor]) -> tuple[NamedSpec, ...]:
    return tuple(
        NamedSpec(k, spec_of(v.dtype, tuple(v.shape), f"Batch input {k!r}"))
        for k, v in batch.items()
    )


def _trace(
    recipe: Recipe,
    hypers: list[Hyper],
    batches: list[dict[str, torch.Tensor]],
    *,
    zero_grads: bool,
) -> tuple[list[Slot], _Bound, dict[str, _Bound]]:
    slots = state_slots(recipe, zero_grads=zero_grads)
    with Sandbox(recipe) as sandbox:
        return _trace_in(recipe, sandbox, slots, hypers, batches, zero_grads=zero_grads)


def _trace_in(
    recipe: Recipe,
    sandbox: Sandbox,
    slots: list[Slot],
    hypers: list[Hyper],
    batches: list[dict[str, torch.Tensor]],
    *,
    zero_grads: bool,
) -> tuple[list[Slot], _Bound, dict[str, _Bound]]:
    grads = {s.name for s in slots if s.kind is StateKind.GRADIENT}
    train: _Bound = []
    for i, batch in enumerate(batches):
        what = "training step" + (f" (shape bucket {i})" if len(batches) > 1 else "")

        def once(batch: dict[str, torch.Tensor] = batch, what: str = what) -> Capture:
            return capture(
                recipe, sandbox, slots, hypers, batch, recipe.step, train=True, what=what
            )

        first = once()
        if zero_grads and first.dropped & grads:
            raise _GradientsDropped
        bound = bind(
            first, once(), slots=slots, hypers=hypers, batch_keys=list(batch), train=True,
            what=what,
        )  # fmt: skip
        train.append((bound, _signature(batch)))
    fns: dict[str, Any] = dict(recipe.entries)
    if recipe.eval_step is not None:
        fns = {"eval": recipe.eval_step, **fns}
    evals: dict[str, _Bound] = {}
    for name, fn in fns.items():
        if name == "train":
            raise ExportError(
                'Recipe.entries may not be called "train"; that entry is the training step.'
            )
        progs = []
        for i, batch in enumerate(batches):
            what = f"{name} step" + (f" (shape bucket {i})" if len(batches) > 1 else "")
            a, b = (
                capture(recipe, sandbox, slots, [], batch, fn, train=False, what=what)
                for _ in range(2)
            )
            bound = bind(
                a, b, slots=slots, hypers=[], batch_keys=list(batch), train=False, what=what
            )
            progs.append((bound, _signature(batch)))
        evals[name] = progs
    return slots, train, evals


def _serialize(bound: BoundProgram, what: str) -> tuple[bytes, str, str]:
    """The program as a checked portable artifact: (bytes, StableHLO target, text)."""
    try:
        data = lower(bound.graph)
    except UnsupportedOperator as e:
        why = f": {e.why}" if e.why else ""
        raise ExportError(
            f"The {what} uses the operator {e.op}, which this front-end cannot lower to "
            f"StableHLO yet{why}. Rewrite that part of the step with other operators, or "
            "export with the torch_xla front-end (stepbundle export --frontend torch_xla)."
        ) from e
    except LoweringError as e:  # pragma: no cover - a bug of a lowering
        raise ExportError(f"Internal error lowering the {what}: {e}. Please report it.") from e

    raw = mlir.parse_artifact(data)
    # jax records where in Python each operation was made (file, line, the caller's
    # frames) as MLIR locations: printed without them and parsed again, the program is
    # the same and the bundle no longer depends on who called export() from where.
    text = raw.text()

    def parse() -> mlir.Module:
        module = mlir.Module.parse_text(raw, text)
        module.strip_attributes()  # aliasing lives in the manifest and is made at load
        return module

    module = parse()
    sig = module.signature()
    if len(sig.inputs) != len(bound.inputs) or len(sig.results) != len(bound.outputs):
        raise ExportError(  # pragma: no cover - the lowering builds the signature
            f"Internal error lowering the {what}: the program has {len(sig.inputs)} inputs "
            f"and {len(sig.results)} outputs, the tables {len(bound.inputs)} and "
            f"{len(bound.outputs)}. Please report this with the recipe."
        )
    bad = module.custom_call_targets() - mlir.ALLOWED_CUSTOM_CALLS
    if bad:
        raise ExportError(
            f"The {what} lowers to custom call(s) {sorted(bad)}, which the runtime does not "
            "allow (they are backend-specific native code)."
        )
    text = module.text()
    errors = []
    for target in mlir.TARGET_CANDIDATES:
        attempt = parse()
        # MLIR prints a failed conversion to stderr unless someone handles it: collect
        # the messages instead (a program that needs a newer target is no error).
        notes: list[str] = []
        attempt._ctx.attach_diagnostic_handler(lambda d, notes=notes: notes.append(str(d)) or True)
        try:
            return attempt.portable_artifact(target), target, text
        except Exception as e:  # the program needs a newer StableHLO than this target
            errors.append(f"{target}: {e} {' '.join(notes)[:300]}")
    raise ExportError(  # pragma: no cover - the newest target takes what jax writes
        f"The {what} could not be serialized as a StableHLO portable artifact at any "
        f"supported target ({'; '.join(errors)})."
    )


def export(
    recipe: Recipe,
    path: str | os.PathLike[str],
    *,
    mlir_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ExportReport:
    """Capture ``recipe``'s step with torch (no torch_xla) and write a bundle to ``path``.

    The user's model, optimizer and torch's RNG state are left as they were: the step
    runs on tracer tensors swapped into the user's objects, and the bundle's initial
    state is the state at the moment of export (with a fresh optimizer's first-step state
    made, as torch would make it).

    Args:
      recipe: the model, optimizer, step and example batches (``stepbundle.exporter.Recipe``).
        ``Recipe.seed`` is the seed the first step's program receives; ``None`` takes
        ``torch.initial_seed()`` (what ``torch.manual_seed`` last set).
      path: where to write the bundle (atomically).
      mlir_dir: if given, each program is also written there as ``.mlir`` text.
      progress: called with a line per stage.

    Raises:
      ExportError: the step cannot be replayed faithfully; the message says why.
    """
    say = progress or (lambda _msg: None)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    if not isinstance(recipe, Recipe):
        raise ExportError(
            f"export() needs a stepbundle.exporter.Recipe, got {type(recipe).__name__}."
        )
    metadata = checked_metadata(recipe.metadata)
    notes = scheduler_notes(recipe.optimizer, recipe.hyperparameters)
    if recipe.numerics != "pytorch":
        # Its programs are written from torch's own decompositions (BatchNorm's statistics
        # by two passes, aten_reduce.py): there are no torch_xla ops to keep.
        raise ExportError(
            f"Recipe.numerics is {recipe.numerics!r}, but the torch front-end computes "
            'PyTorch\'s numerics only ("pytorch"): without torch_xla there are no '
            "torch_xla BatchNorm ops to keep. Leave numerics at its default, or export "
            'with stepbundle.exporter.export for numerics="torch_xla".'
        )
    base_seed = torch.initial_seed() if recipe.seed is None else int(recipe.seed)
    if not 0 <= base_seed < 2**64:
        raise ExportError(f"Recipe.seed must be in [0, 2**64), got {base_seed}.")
    batches = [_batch(b, f"example batch {i}") for i, b in enumerate(recipe.all_batches())]
    hypers = _hyperparameters(recipe)
    for zero_grads in (True, False):
        try:
            slots, train_bound, eval_bound = _trace(recipe, hypers, batches, zero_grads=zero_grads)
            break
        except _GradientsDropped:
            continue
    say(
        f"captured: {2 * len(batches)} training steps"
        + (f", {len(eval_bound)} read-only entries" if eval_bound else "")
        + f"; {len(slots)} state tensors"
    )
    times["trace"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    all_bound = train_bound + [p for ps in eval_bound.values() for p in ps]
    referenced = {i.name for b, _ in all_bound for i in b.inputs if isinstance(i, StateInput)}
    referenced |= {o.state for b, _ in all_bound for o in b.outputs if isinstance(o, StateUpdateOutput)}  # fmt: skip
    state_entries: list[StateEntry] = []
    payloads: list[codec.SectionPayload] = []
    non_persistent = non_persistent_buffers(recipe.model)
    for s in slots:
        # Gradients are state only when the step keeps or reads them.
        if s.kind is StateKind.GRADIENT and s.name not in referenced:
            continue
        section = f"state/{s.name}"
        state_entries.append(
            StateEntry(
                name=s.name,
                kind=s.kind,
                spec=spec_of(s.value.dtype, tuple(s.value.shape), f"State {s.name!r}"),
                section=section,
                trainable=s.trainable,
                aliases=s.aliases,
            )
        )
        kind, data = initial_section(
            s, s.value, include_state=recipe.include_state, non_persistent=non_persistent
        )
        payloads.append(codec.SectionPayload(section, kind, data))
    by_rule = {SectionKind.FILL, SectionKind.EXTERNAL} & {p.kind for p in payloads}
    uses_seed = False
    entries: dict[str, Entry] = {}
    texts: dict[str, str] = {}
    for entry_name, progs, updates in [("train", train_bound, True)] + [
        (n, ps, False) for n, ps in eval_bound.items()
    ]:
        programs = []
        for i, (bound, batch_sig) in enumerate(progs):
            uses_seed |= any(inp.kind is InputKind.RNG_SEED for inp in bound.inputs)
            artifact, target, text = _serialize(bound, f"{entry_name} program {i}")
            section = f"program/{entry_name}/{i}"
            payloads.append(codec.SectionPayload(section, SectionKind.PROGRAM, artifact))
            texts[f"{entry_name}.{i}"] = text
            programs.append(
                Program(
                    section=section,
                    stablehlo_version=target,
                    inputs=bound.inputs,
                    outputs=bound.outputs,
                    batch=batch_sig,
                )
            )
        entries[entry_name] = Entry(
            programs=tuple(programs), updates_state=updates, eval_modules=progs[0][0].eval_modules
        )
    hyper_records = tuple(
        Hyperparameter(
            name=h.name, spec=spec_of(HYPERPARAMETER_DTYPE, (), f"Hyperparameter {h.name!r}"),
            value=h.value,
        )
        for h in hypers
    )  # fmt: skip
    manifest = Manifest(
        producer=_producer(),
        entries=entries,
        state=tuple(state_entries),
        hyperparameters=hyper_records,
        rng=Rng(seed=base_seed) if uses_seed else None,
        sections=(),
        metadata=metadata,
        required_features=(codec.STATE_INITIALIZERS,) if by_rule else (),
        numerics="pytorch",
        matmul_precision=_TORCH_MATMUL_PRECISION[torch.get_float32_matmul_precision()],
    )
    times["lower"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    bundle_path = Path(path)
    manifest = codec.write_bundle(bundle_path, manifest, payloads)
    if mlir_dir is not None:
        d = Path(mlir_dir)
        d.mkdir(parents=True, exist_ok=True)
        for key, text in texts.items():
            codec.atomic_write(d / f"{bundle_path.name}.{key}.mlir", [text.encode("utf-8")])
    times["write"] = time.perf_counter() - t2
    with codec.open_bundle(bundle_path) as b:
        digest, size = b.digest, b.file_size
    counts: dict[str, int] = {}
    for prog in manifest.entries["train"].programs:
        for inp in prog.inputs:
            counts[inp.kind.value] = counts.get(inp.kind.value, 0) + 1
    say(f"wrote {bundle_path} ({size / 1e6:.2f} MB, {digest})")
    for note in notes:
        say(f"note: {note}")
        warnings.warn(note, UserWarning, stacklevel=2)
    return ExportReport(bundle_path, manifest, digest, size, times, counts, notes)
