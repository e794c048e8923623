"""``export(recipe, path)``: trace a training step, bind every input and output, write a bundle.

Stages: copy the model and optimizer to the XLA device (``workspace.py``); trace each
shape bucket's training step twice and the read-only entries twice (``trace.py``);
prove the two traces agree and build the binding tables (``bind.py``); rewrite each
graph for ``Recipe.numerics`` and serialize it as a StableHLO portable artifact
(``serialize.py``); write the bundle (``stepbundle.frontend.writer``, shared with the
torch front-end).

Imports: torch, torch_xla (through ``xla.py`` only), jaxlib's MLIR bindings (through
stepbundle.stablehlo), stepbundle.schema, stepbundle.frontend.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from stepbundle.frontend.errors import ExportError, MetaTensorError
from stepbundle.frontend.initial_state import non_persistent_buffers
from stepbundle.frontend.progress import CHECK_STAGE, Ticker, counted, no_ticks, ticking
from stepbundle.frontend.recipe import Recipe, checked_metadata, read_only_entries, step_label
from stepbundle.frontend.schedulers import scheduler_notes
from stepbundle.frontend.step_check import (
    UNCHECKED,
    RuntimeStep,
    check_bundle,
    check_wanted,
    runtime_ahead,
)
from stepbundle.frontend.step_io import batch_signature, checked_batch
from stepbundle.frontend.writer import (
    ExportReport,
    Lowered,
    ProgramDraft,
    producer,
    write_bundle,
)
from stepbundle.schema.manifest import NamedSpec, Rng, StateKind
from stepbundle.schema.version import RNG_RESTORED_DRAWS

from . import xla
from .bind import BoundProgram, GraphChanged, bind
from .check import references
from .gradients import GradientsDropped, NoGradient, gradients_reached
from .graphdiff import explain_graph_change
from .numerics import checked_numerics
from .serialize import lower_program
from .trace import trace_eval, trace_train
from .workspace import StateTensor, Workspace

__all__ = ["ExportReport", "export"]  # ExportReport: stepbundle.frontend.writer's


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
    run: bool = False,
    tick: Ticker = no_ticks,
) -> tuple[list[Any], dict[str, torch.Tensor], dict[str, float], _Bound, dict[str, _Bound]]:
    """Copy the recipe to the device, trace every entry twice, bind the traces.

    ``tick`` hears each stage; a traced step says how far it is in operators traced
    (torch_xla's op counters), the second trace of a step out of as many as the first.
    """

    def tracing(stage: str, total: int | None = None) -> Any:
        start = xla.ops_traced()
        return ticking(tick, stage, lambda: xla.ops_traced() - start, total=total)

    tick("copying the model and optimizer to the XLA device", 0, None)
    with Workspace(recipe, device, zero_grads=zero_grads, no_gradient=no_gradient) as ws:
        batches = [
            {k: v.to(device) for k, v in checked_batch(b, f"example batch {i}").items()}
            for i, b in enumerate(recipe.all_batches())
        ]
        xla.sync()
        initial = ws.state_tensors()
        # The bundle's initial state: the state at the moment of export, on the host.
        initial_values = _initial_values(recipe, initial, ws)
        initial_hyper = {n: float(t.detach().cpu()) for n, t in ws.hyperparameters.items()}
        kinds = {s.name: s.kind for s in initial}
        say(f"prepared: {counted(len(initial), 'state tensor')} on {device}")
        if ws.capturable_note:
            say(f"note: {ws.capturable_note}")

        hints = ws.optimizer_hints()
        host_state = ws.host_state()
        if host_state:
            hints.append(
                f"{', '.join(host_state[:3])} live(s) on the host, not the XLA device, so "
                "their values enter the graph as numbers."
            )
        train_bound: _Bound = []
        for i, batch in enumerate(batches):
            what = step_label("training step", i, len(batches))
            with (
                gradients_reached(ws.model, watch=zero_grads and i == 0) as reached,
                tracing(f"tracing the {what} (1 of 2)") as traced,
            ):
                ta = trace_train(
                    ws, batch, recipe.step, seed=base_seed if i == 0 else None, run=run
                )
            trainable = [(n, p) for n, p in ws.model.named_parameters() if p.requires_grad]
            if zero_grads and any(p.grad is None for n, p in trainable if n not in no_gradient):
                raise GradientsDropped
            unreached = frozenset(n for n, _ in trainable if n not in reached) - no_gradient
            if zero_grads and i == 0 and unreached:
                raise NoGradient(unreached)
            with tracing(f"tracing the {what} (2 of 2)", traced.done or None):
                tb = trace_train(ws, batch, recipe.step, run=run)
            tick(f"comparing the traces of the {what}", 0, None)
            bound = bind(
                ta,
                tb,
                what=what,
                state_kinds=kinds,
                hints=hints,
                constant_prefix=f"train.{i}.constant.",
            )
            train_bound.append((bound, batch_signature(recipe.all_batches()[i])))
        eval_fns = read_only_entries(recipe)
        eval_bound: dict[str, _Bound] = {}
        for name, fn in eval_fns.items():
            progs = []
            for i, batch in enumerate(batches):
                what = step_label(f"{name} step", i, len(batches))
                with tracing(f"tracing the {what} (twice)"):
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
                progs.append((bound, batch_signature(recipe.all_batches()[i])))
            eval_bound[name] = progs
        xla.sync()
        say(
            f"traced: the step {2 * len(batches)} times (twice per batch shape: a value "
            "that differs between the two traces is a graph input, not a constant)"
            + (
                f", {counted(len(eval_fns), 'read-only entry', 'read-only entries')}"
                if eval_fns
                else ""
            )
        )
        return initial, initial_values, initial_hyper, train_bound, eval_bound


def _initial_values(
    recipe: Recipe, initial: list[StateTensor], ws: Workspace
) -> dict[str, torch.Tensor]:
    """The state at the moment of export, as CPU tensors for the writer, copied from the
    device only where the host has no such value.

    A weights-free bundle stores no value for parameters and persistent buffers (the
    writer reads only their dtype and shape: ``frontend.initial_state``), so they get a
    meta tensor instead of a copy: the copies were 4 bytes per parameter, and more while
    copying (issue #40: a 117M Llama ran out of a 12 GB address space right here). Every
    other tensor the workspace made has its value on the host already
    (``Workspace.host_value``): the user's own tensor it copied, or, for the state it made
    (a fresh optimizer's moments, zero gradients), one element expanded to its shape,
    which the writer stores as a fill without ever materializing it. Copying those from
    the device cost 12 bytes per parameter with AdamW (issue #40). What is left (a tensor
    the user put on the XLA device) is copied; a host tensor of the workspace (a
    non-capturable Adam's step count) is cloned, since the traced step writes to it.
    """
    non_persistent = non_persistent_buffers(recipe.model)

    def value(s: StateTensor) -> torch.Tensor:
        t = s.tensor.detach()
        model_state = s.kind is StateKind.PARAMETER or (
            s.kind is StateKind.BUFFER
            and not all(n in non_persistent for n in (s.name, *s.aliases))
        )
        if not recipe.include_state and model_state:
            return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
        host = ws.host_value(s.tensor)
        if host is not None:
            return host
        return t.cpu() if t.device.type != "cpu" else t.clone()

    return {s.name: value(s) for s in initial}


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
            "load(path, options=LoadOptions(parallel=ParallelOptions(devices=N))) or `stepbundle run --devices N` splits the batch over "
            "N devices with no re-export."
        )


def export(
    recipe: Recipe,
    path: str | os.PathLike[str],
    *,
    mlir_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
    check: bool | None = None,
    ticker: Ticker | None = None,
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
      ticker: called as the export moves through its stages, with how far it is
        (``stepbundle.frontend.progress``; the CLI draws it as a progress line).
      check: after writing, step the bundle once on the CPU through the runtime (in a
        child process) and the recipe once eagerly on a copy, and refuse when a metric
        or state tensor differs beyond float32 rounding (``stepbundle.frontend.step_check``;
        the reference is PyTorch on the CPU, or torch_xla eager where the bundle draws
        XLA's random numbers or keeps its BatchNorm, ``check.py``). False skips it (a
        model too big to step on this machine's CPU); None (the default): on, unless
        the environment sets ``STEPBUNDLE_EXPORT_CHECK=0``.

    Raises:
      ExportError: the step cannot be replayed faithfully; the message says why.
      CheckFailed: the check found the bundle's step computing something else (the
        bundle is removed); an ``ExportError``.
    """
    # The check's runtime process starts now and imports the runtime while the step is
    # traced (``runtime_ahead``).
    with runtime_ahead(check_wanted(check)) as runtime:
        return export_running_traced_steps(
            recipe,
            path,
            mlir_dir=mlir_dir,
            progress=progress,
            check=check,
            run_traced_steps=False,
            ticker=ticker,
            runtime=runtime,
        )


def _refuse_meta(recipe: Recipe) -> None:
    """A model on the ``meta`` device (built for a weights-free export) cannot be traced
    by torch_xla, which copies every state tensor to its device first."""
    model, opt = recipe.model, recipe.optimizer
    named = [*model.named_parameters(), *model.named_buffers()]
    # optimizer state the user left on meta is copied to the device too
    param_name = {id(p): n for n, p in model.named_parameters()}
    for p, st in getattr(opt, "state", {}).items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                named.append((f"optimizer.state.{param_name.get(id(p), '?')}.{key}", v))
    meta = [name for name, t in named if t.is_meta]
    if meta:
        raise MetaTensorError(
            f"{len(meta)} tensor(s) of the model or its optimizer state are on the meta device "
            f"(first: {meta[0]!r}); "
            "the torch_xla front-end copies the state to its device to trace, so it needs real "
            "tensors. Export a meta-device model with the torch front-end (`stepbundle export "
            "--frontend torch --no-state`, or stepbundle.export_torch.export with "
            "Recipe(include_state=False)), or build the model on the CPU."
        )


def export_running_traced_steps(
    recipe: Recipe,
    path: str | os.PathLike[str],
    *,
    run_traced_steps: bool,
    mlir_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
    check: bool | None = None,
    ticker: Ticker | None = None,
    runtime: RuntimeStep | None = None,
) -> ExportReport:
    """``export``, with the internal knob ``run_traced_steps`` (not part of the public face).

    ``run_traced_steps=True`` compiles and runs each traced training step, as torch_xla
    eager would, instead of dropping it (``export``'s way, ``xla.skip_step``). The bundle
    is the same either way; running costs the steps' compile time (most of an export's),
    and is there to check that claim (``tests/exporter/test_export_skip_steps.py``) and to
    time it (``benchmarks/export_time.py``). ``runtime``: the check's runtime process,
    started ahead (``runtime_ahead``; None: the check starts it). The other arguments are
    ``export``'s.
    """
    say = progress or (lambda _msg: None)
    tick = ticker or no_ticks
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    xla.check_version()
    device = xla.device()
    if not isinstance(recipe, Recipe):
        raise ExportError(
            f"export() needs a stepbundle.exporter.Recipe, got {type(recipe).__name__}."
        )
    _refuse_meta(recipe)
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
                    run=run_traced_steps,
                    tick=tick,
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
                    run=run_traced_steps,
                )
                explain_graph_change(e, retrace)
    finally:
        xla.set_rng_state(saved_rng)
    initial, initial_values, initial_hyper, train_bound, eval_bound = traced
    times["trace"] = time.perf_counter() - t0

    def draft(bound: BoundProgram, batch: tuple[NamedSpec, ...]) -> ProgramDraft:
        def lower(what: str) -> Lowered:
            tick(f"lowering the {what}", 0, None)
            artifact, target, text, rewritten = lower_program(
                bound, len(bound.outputs), what, numerics
            )
            return Lowered(artifact, target, text, rewritten)

        return ProgramDraft(
            bound.inputs, bound.outputs, batch, lower, bound.constants, bound.eval_modules
        )

    entries = {
        name: [draft(b, sig) for b, sig in progs]
        for name, progs in [("train", train_bound), *eval_bound.items()]
    }
    trains = [b for b, _ in train_bound]
    report = write_bundle(
        recipe,
        path,
        state=[(s, initial_values[s.name]) for s in initial],
        entries=entries,
        hyperparameters=initial_hyper,
        producer=producer(xla.torch_xla_version()),
        rng=lambda: (
            _rng(base_seed, trains),
            (RNG_RESTORED_DRAWS,) if trains[0].step_draws else (),
        ),
        metadata=metadata,
        numerics=numerics,
        matmul_precision=matmul_precision,
        notes=notes,
        mlir_dir=mlir_dir,
        say=say,
        times=times,
    )
    close = getattr(ticker, "close", None)
    if callable(close):  # the last stage's line ends before the check's lines
        close()
    if check_wanted(check):
        t1 = time.perf_counter()
        # a stage of its own: it starts the runtime in a child and steps the model
        tick(CHECK_STAGE, 0, None)
        plain, random = references(numerics, report.numerics_rewrites)
        report.check = check_bundle(
            recipe,
            report.path,
            report.manifest,
            reference=plain,
            random_reference=random,
            say=say,
            runtime=runtime,
        )
        if callable(close):
            close()
        if not report.check.ran:
            say(report.check.line())
        times["check"] = time.perf_counter() - t1
    else:
        say(UNCHECKED)
    return report
