"""``export(recipe, path)``: trace a training step, bind every input and output, write a bundle.

Stages: copy the model and optimizer to the XLA device (``workspace.py``); trace each
shape bucket's training step twice and the read-only entries twice (``trace.py``);
prove the two traces agree and build the binding tables (``bind.py``); rewrite each
graph for ``Recipe.numerics`` and serialize it as a StableHLO portable artifact
(``serialize.py``); write the bundle (``stepbundle.schema``).

Imports: torch, torch_xla (through ``xla.py`` only), jaxlib's MLIR bindings (through
stepbundle.stablehlo), stepbundle.schema.
"""

from __future__ import annotations

import functools
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
from stepbundle.schema.manifest import (
    ConstantInput,
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
from stepbundle.schema.version import RNG_RESTORED_DRAWS

from . import xla
from .bind import BoundProgram, GraphChanged, bind
from .dtypes import HYPERPARAMETER_DTYPE, spec_of, tensor_bytes
from .errors import ExportError
from .gradients import GradientsDropped, NoGradient, gradients_reached
from .graphdiff import explain_graph_change
from .initial_state import initial_section, non_persistent_buffers
from .numerics import checked_numerics
from .recipe import Recipe, checked_metadata
from .schedulers import scheduler_notes
from .serialize import lower_program
from .trace import trace_eval, trace_train
from .workspace import Workspace

__all__ = ["ExportReport", "export"]


@dataclass
class ExportReport:
    """What an export did, for the CLI and for people reading logs.

    Attributes:
      path: the bundle written.
      manifest: its manifest.
      digest: the bundle digest ("sha256:...").
      size: the file size in bytes.
      stage_seconds: wall time of each stage.
      input_counts: number of graph inputs of each kind, over the train programs.
      numerics_rewrites: ops the exporter rewrote for ``Recipe.numerics`` over all
        programs (training BatchNorm's ``batch_norm_training`` / ``batch_norm_grad``);
        0 with ``numerics="torch_xla"``, or when the step has none.
      notes: what the user should know about the bundle written (optimizer settings a
        scheduler set and the bundle keeps fixed, ``exporter/schedulers.py``); each is
        also given to ``progress`` and issued as a ``UserWarning``.
    """

    path: Path
    manifest: Manifest
    digest: str
    size: int
    stage_seconds: dict[str, float] = field(default_factory=dict)
    input_counts: dict[str, int] = field(default_factory=dict)
    numerics_rewrites: int = 0
    notes: list[str] = field(default_factory=list)


def _versions() -> Producer:
    import jax

    return Producer(
        stepbundle=__version__,
        torch=str(torch.__version__),
        torch_xla=xla.torch_xla_version(),
        jax=str(jax.__version__),
    )


def _to_device(
    batch: Mapping[str, torch.Tensor], device: torch.device, which: str
) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in batch.items():
        if not isinstance(k, str) or not k:
            raise ExportError(f"The {which} has a key {k!r}; batch keys must be non-empty strings.")
        if not isinstance(v, torch.Tensor):
            raise ExportError(
                f"The {which} maps {k!r} to {type(v).__name__}; every batch value must be a "
                "tensor (the runtime feeds arrays)."
            )
        out[k] = v.detach().to(device)
    return out


def _rng(seed: int, trains: list[BoundProgram]) -> Rng:
    """The manifest's RNG state: the seed, and the draws a mid-step restore implies."""
    draws = sorted({b.step_draws or 0 for b in trains})
    if len(draws) > 1:
        raise ExportError(
            f"The training step's shape buckets leave torch_xla's RNG state after different "
            f"numbers of draws ({draws}), so one seed rule cannot serve them all. Export one "
            "bundle per batch shape, or draw the same random numbers for every shape."
        )
    return Rng(
        seed=seed,
        restored_after_draws=tuple(k for _, k in trains[0].derived_seeds),
        step_after_draws=draws[0],
    )


_Bound = list[tuple[BoundProgram, tuple[NamedSpec, ...]]]


def _trace_recipe(
    recipe: Recipe,
    device: torch.device,
    base_seed: int,
    *,
    zero_grads: bool,
    say: Callable[[str], None],
    no_gradient: frozenset[str] = frozenset(),
) -> tuple[list[Any], dict[str, torch.Tensor], dict[str, float], _Bound, dict[str, _Bound]]:
    """Copy the recipe to the device, trace every entry twice, bind the traces."""
    with Workspace(recipe, device, zero_grads=zero_grads, no_gradient=no_gradient) as ws:
        batches = [
            _to_device(b, device, f"example batch {i}") for i, b in enumerate(recipe.all_batches())
        ]
        xla.sync()
        initial = ws.state_tensors()
        # The bundle's initial state: the state at the moment of export (CPU copies).
        initial_values = {s.name: s.tensor.detach().cpu().clone() for s in initial}
        initial_hyper = {n: float(t.detach().cpu()) for n, t in ws.hyperparameters.items()}
        kinds = {s.name: s.kind for s in initial}
        say(f"prepared: {len(initial)} state tensors on {device}")

        hints = ws.optimizer_hints()
        host_state = ws.host_state()
        if host_state:
            hints.append(
                f"{', '.join(host_state[:3])} live(s) on the host, not the XLA device, so "
                "their values enter the graph as numbers."
            )
        train_bound: _Bound = []
        for i, batch in enumerate(batches):
            what = "training step" + (f" (shape bucket {i})" if len(batches) > 1 else "")
            with gradients_reached(ws.model, watch=zero_grads and i == 0) as reached:
                ta = trace_train(ws, batch, recipe.step, seed=base_seed if i == 0 else None)
            trainable = [(n, p) for n, p in ws.model.named_parameters() if p.requires_grad]
            if zero_grads and any(p.grad is None for n, p in trainable if n not in no_gradient):
                raise GradientsDropped
            unreached = frozenset(n for n, _ in trainable if n not in reached) - no_gradient
            if zero_grads and i == 0 and unreached:
                raise NoGradient(unreached)
            tb = trace_train(ws, batch, recipe.step)
            bound = bind(
                ta,
                tb,
                what=what,
                state_kinds=kinds,
                hints=hints,
                constant_prefix=f"train.{i}.constant.",
            )
            train_bound.append((bound, _batch_signature(recipe.all_batches()[i])))
        eval_fns: dict[str, Any] = dict(recipe.entries)
        if recipe.eval_step is not None:
            eval_fns = {"eval": recipe.eval_step, **eval_fns}
        eval_bound: dict[str, _Bound] = {}
        for name, fn in eval_fns.items():
            if name == "train":
                raise ExportError(
                    'Recipe.entries may not be called "train"; that entry is the training step.'
                )
            progs = []
            for i, batch in enumerate(batches):
                what = f"{name} step" + (f" (shape bucket {i})" if len(batches) > 1 else "")
                ta = trace_eval(ws, batch, fn, what)
                tb = trace_eval(ws, batch, fn, what)
                bound = bind(
                    ta,
                    tb,
                    what=what,
                    state_kinds=kinds,
                    hints=[],
                    constant_prefix=f"{name}.{i}.constant.",
                )
                progs.append((bound, _batch_signature(recipe.all_batches()[i])))
            eval_bound[name] = progs
        xla.sync()
        say(
            f"traced: {2 * len(batches)} training steps"
            + (f", {len(eval_fns)} read-only entries" if eval_fns else "")
        )
        return initial, initial_values, initial_hyper, train_bound, eval_bound


def _quiet(_msg: str) -> None:
    pass


def _refuse_spmd() -> None:
    """torch_xla's SPMD mode is not exported: its sharded device data do not keep the
    tensor identities the binding tables are built from."""
    if xla.is_spmd():
        raise ExportError(
            "torch_xla is in SPMD mode (xr.use_spmd() was called), which the exporter does "
            "not support: bundles keep no xs.mark_sharding annotations. Export the step "
            "without SPMD mode, on one device, and run the bundle data-parallel instead: "
            "load(path, devices=N) or `stepbundle run --devices N` splits the batch over "
            "N devices with no re-export."
        )


def export(
    recipe: Recipe,
    path: str | os.PathLike[str],
    *,
    mlir_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ExportReport:
    """Trace ``recipe``'s step with torch_xla and write a bundle to ``path``.

    The user's model, optimizer and torch_xla RNG state are left as they were: tracing
    runs on device copies, and the bundle's initial state is the state at the moment
    of export (with a fresh optimizer's first-step state materialized).

    Args:
      recipe: the model, optimizer, step and example batches.
      path: where to write the bundle (atomically).
      mlir_dir: if given, each program is also written there as ``.mlir`` text.
      progress: called with a line per stage (the CLI prints them).

    Raises:
      ExportError: the step cannot be replayed faithfully; the message says why.
    """
    say = progress or (lambda _msg: None)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    xla.check_version()
    device = xla.device()
    if not isinstance(recipe, Recipe):
        raise ExportError(
            f"export() needs a stepbundle.exporter.Recipe, got {type(recipe).__name__}."
        )
    _refuse_spmd()
    metadata = checked_metadata(recipe.metadata)
    numerics = checked_numerics(recipe.numerics)
    # The precision torch_xla traces at, recorded so the runtime compiles at the same.
    matmul_precision = xla.matmul_precision()
    # Read before the workspace puts tensors in param_groups.
    notes = scheduler_notes(recipe.optimizer, recipe.hyperparameters)
    # Read the RNG state before anything syncs: every sync advances it.
    saved_rng = xla.get_rng_state()
    base_seed = saved_rng if recipe.seed is None else int(recipe.seed)
    if not 0 <= base_seed < 2**64:
        raise ExportError(f"Recipe.seed must be in [0, 2**64), got {base_seed}.")
    try:
        xla.sync()
        # First assume the step keeps its gradients (they are then state, starting at
        # zero); a step that drops them at its end is traced again without.
        # Parameters no gradient reaches keep a None grad, as in eager (traced again
        # once they are known).
        zero_grads, no_gradient = True, frozenset[str]()
        while True:
            try:
                traced = _trace_recipe(
                    recipe,
                    device,
                    base_seed,
                    zero_grads=zero_grads,
                    say=say,
                    no_gradient=no_gradient,
                )
                break
            except GradientsDropped:
                zero_grads, no_gradient = False, frozenset()
            except NoGradient as e:
                no_gradient = no_gradient | e.names
                say(f"no gradient reaches {e}: traced again with their grads None")
            except GraphChanged as e:
                retrace = functools.partial(
                    _trace_recipe,
                    recipe,
                    device,
                    base_seed,
                    zero_grads=zero_grads,
                    say=_quiet,
                    no_gradient=no_gradient,
                )
                explain_graph_change(e, retrace)
    finally:
        xla.set_rng_state(saved_rng)
    initial, initial_values, initial_hyper, train_bound, eval_bound = traced
    times["trace"] = time.perf_counter() - t0

    # ---------------------------------------------------------------- tables
    t2 = time.perf_counter()
    referenced: set[str] = set()
    for bound, _ in train_bound + [p for ps in eval_bound.values() for p in ps]:
        for inp in bound.inputs:
            if isinstance(inp, StateInput):
                referenced.add(inp.name)
        for out in bound.outputs:
            if isinstance(out, StateUpdateOutput):
                referenced.add(out.state)
    state_entries: list[StateEntry] = []
    payloads: list[codec.SectionPayload] = []
    non_persistent = non_persistent_buffers(recipe.model)
    for s in initial:
        # Gradients are state only when the step keeps or reads them.
        if s.kind is StateKind.GRADIENT and s.name not in referenced:
            continue
        value = initial_values[s.name]
        section = f"state/{s.name}"
        state_entries.append(
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
    known = {e.name for e in state_entries}
    by_rule = {SectionKind.FILL, SectionKind.EXTERNAL} & {p.kind for p in payloads}
    uses_seed = False
    rewrites = 0
    entries: dict[str, Entry] = {}
    texts: dict[str, str] = {}
    for entry_name, progs, updates in [("train", train_bound, True)] + [
        (n, ps, False) for n, ps in eval_bound.items()
    ]:
        programs = []
        for i, (bound, batch_sig) in enumerate(progs):
            what = f"{entry_name} program {i}"
            for inp in bound.inputs:
                if isinstance(inp, StateInput) and inp.name not in known:  # pragma: no cover
                    raise ExportError(f"Internal error: {what} reads unknown state {inp.name!r}.")
                if inp.kind is InputKind.RNG_SEED:
                    uses_seed = True
            artifact, target, text, rewritten = lower_program(
                bound, len(bound.outputs), what, numerics
            )
            rewrites += rewritten
            section = f"program/{entry_name}/{i}"
            payloads.append(codec.SectionPayload(section, SectionKind.PROGRAM, artifact))
            for inp in bound.inputs:
                if isinstance(inp, ConstantInput):
                    payloads.append(
                        codec.SectionPayload(
                            inp.section, SectionKind.TENSOR, tensor_bytes(bound.constants[inp.name])
                        )
                    )
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
            programs=tuple(programs),
            updates_state=updates,
            eval_modules=progs[0][0].eval_modules,
        )
    hypers = tuple(
        Hyperparameter(
            name=n, spec=spec_of(HYPERPARAMETER_DTYPE, (), f"Hyperparameter {n!r}"), value=v
        )
        for n, v in initial_hyper.items()
    )
    manifest = Manifest(
        producer=_versions(),
        entries=entries,
        state=tuple(state_entries),
        hyperparameters=hypers,
        rng=_rng(base_seed, [b for b, _ in train_bound]) if uses_seed else None,
        sections=(),
        metadata=metadata,
        required_features=((codec.STATE_INITIALIZERS,) if by_rule else ())
        + ((RNG_RESTORED_DRAWS,) if uses_seed and train_bound[0][0].step_draws else ()),
        numerics=numerics,
        matmul_precision=matmul_precision,
    )
    times["lower"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    bundle_path = Path(path)
    manifest = codec.write_bundle(bundle_path, manifest, payloads)
    if mlir_dir is not None:
        d = Path(mlir_dir)
        d.mkdir(parents=True, exist_ok=True)
        for key, text in texts.items():
            codec.atomic_write(d / f"{bundle_path.name}.{key}.mlir", [text.encode("utf-8")])
    times["write"] = time.perf_counter() - t3
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
    return ExportReport(bundle_path, manifest, digest, size, times, counts, rewrites, notes)


def _batch_signature(batch: Mapping[str, torch.Tensor]) -> tuple[NamedSpec, ...]:
    return tuple(
        NamedSpec(k, spec_of(v.dtype, tuple(v.shape), f"Batch input {k!r}"))
        for k, v in batch.items()
    )
