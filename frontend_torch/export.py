"""``export(recipe, path)``: capture a training step with torch alone and write a bundle.

Stages: list the recipe's state (``state.py``); capture each shape bucket's training
step twice and each read-only entry twice (``capture.py``); prove the two captures are
one program and build its binding tables (``bind.py``); lower each program to StableHLO
through jax (``lowering.py``); write the bundle with the writer both front-ends share
(``stepbundle.frontend.writer``), for the same runtime.

Imports: torch, jax, stepbundle.schema, stepbundle.stablehlo, stepbundle.frontend (the
front-end core; never torch_xla).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch
from torch import fx

from stepbundle.frontend.dtypes import HYPERPARAMETER_DTYPE
from stepbundle.frontend.errors import ExportError, MetaTensorError
from stepbundle.frontend.fresh_state import take_capturable
from stepbundle.frontend.hyperparameters import declared_values
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
from stepbundle.stablehlo import artifact as mlir

from .bind import BoundProgram, bind
from .capture import Capture, Hyper, capture
from .check import draws_of, replaying
from .lowering import LoweringError, UnsupportedOperator, lower
from .state import Sandbox, Slot, state_slots

__all__ = ["FRONTEND", "NO_TORCH_XLA", "ExportReport", "export"]

FRONTEND = "stepbundle.export_torch"
"""The name this front-end gives itself in a bundle's producer record."""

NO_TORCH_XLA = f"none (front-end {FRONTEND})"
"""``Producer.torch_xla`` of a bundle this front-end wrote: no torch_xla was involved."""


# torch.get_float32_matmul_precision() as StableHLO's precision_config: "highest" (PyTorch's
# default) is full float32, "high" allows TF32 or bf16x3, "medium" bf16 passes.
_TORCH_MATMUL_PRECISION: dict[str, str] = {
    "highest": "highest",
    "high": "high",
    "medium": "default",
}

_aten = torch.ops.aten

# The operators this front-end lowers to matrix products (aten_math._dot, aten_nn._conv,
# aten_nn._attention), each with the position of an operand whose dtype is the product's.
_PRODUCTS: dict[object, int] = {
    _aten.mm.default: 0,
    _aten.bmm.default: 0,
    _aten.addmm.default: 1,
    _aten.convolution.default: 0,
    _aten.convolution_backward.default: 0,
    _aten._scaled_dot_product_flash_attention_for_cpu.default: 0,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 0,
}


# The summed dimension of the operand above, for the plain matrix products.
_SUMMED: dict[object, int] = {_aten.mm.default: 1, _aten.bmm.default: 2, _aten.addmm.default: 1}


def _has_float32_products(programs: list[BoundProgram]) -> bool:
    """Whether any matrix product of ``programs`` takes float32 (or float64) operands:
    the only products torch's float32 matmul precision governs. Under bf16 autocast a
    step's products all take bf16 operands, computed alike at every setting; an outer
    product (nothing summed) is one multiplication per element, exact at any setting."""
    for program in programs:
        for node in program.graph.gm.graph.nodes:
            at = _PRODUCTS.get(node.target) if node.op == "call_function" else None
            if at is None:
                continue
            operand = node.args[at]
            val = getattr(operand, "meta", {}).get("val")
            if not isinstance(val, torch.Tensor) or val.dtype not in (torch.float32, torch.float64):
                continue
            summed = _SUMMED.get(node.target)
            if summed is not None and int(val.shape[summed]) == 1:
                continue  # an outer product: lowered as a multiplication (aten_math._dot)
            return True
    return False


def _matmul_precision(programs: list[BoundProgram], say: Callable[[str], None]) -> str:
    """The precision the bundle records: torch's float32 matmul precision where the
    programs have float32 products, else "default" (docs/tpu.md, "What torch's float32
    matmul precision means here"): with no float32 product, "highest" would change no
    value and would only keep a TPU from its fused attention kernels."""
    setting = torch.get_float32_matmul_precision()
    recorded = _TORCH_MATMUL_PRECISION[setting]
    if recorded != "default" and not _has_float32_products(programs):
        say(
            f'matmul precision: default (torch\'s float32 matmul precision "{setting}" '
            "governs no product of this step: every one takes bf16 or fp16 operands)"
        )
        return "default"
    return recorded


def _hyperparameters(recipe: Recipe) -> list[Hyper]:
    # The value the program input holds (float32), as the torch_xla front-end records it.
    return [
        Hyper(
            d.name,
            d.group,
            d.key,
            float(torch.tensor(d.value, dtype=HYPERPARAMETER_DTYPE)),
            d.index,
        )
        for d in declared_values(recipe.optimizer, recipe.hyperparameters)
    ]


class _GradientsDropped(Exception):
    """The step sets gradients to None: trace again without materialized gradients."""


_Bound = list[tuple[BoundProgram, tuple[NamedSpec, ...]]]


def _trace(
    recipe: Recipe,
    hypers: list[Hyper],
    batches: list[dict[str, torch.Tensor]],
    *,
    zero_grads: bool,
    say: Callable[[str], None],
    tick: Ticker = no_ticks,
) -> tuple[list[Slot], _Bound, dict[str, _Bound], int]:
    slots = state_slots(recipe, zero_grads=zero_grads)
    with Sandbox(recipe) as sandbox:
        # param_groups are put back when the sandbox closes
        note = take_capturable(recipe.optimizer)
        if note and zero_grads:
            say(f"note: {note}")
        return _trace_in(recipe, sandbox, slots, hypers, batches, zero_grads=zero_grads, tick=tick)


def _last_size(graphs: list[fx.Graph]) -> int:
    """The node count of the last graph in ``graphs`` (0 before the first)."""
    return len(graphs[-1].nodes) if graphs else 0


def _trace_in(
    recipe: Recipe,
    sandbox: Sandbox,
    slots: list[Slot],
    hypers: list[Hyper],
    batches: list[dict[str, torch.Tensor]],
    *,
    zero_grads: bool,
    tick: Ticker = no_ticks,
) -> tuple[list[Slot], _Bound, dict[str, _Bound], int]:
    """The state slots, the bound programs of the training step (one per example batch)
    and of each read-only entry, and the most checkpointed segments one training step
    ran (``Capture.checkpointed``)."""
    grads = {s.name for s in slots if s.kind is StateKind.GRADIENT}
    train: _Bound = []
    segments = 0
    for i, batch in enumerate(batches):
        what = step_label("training step", i, len(batches))

        def once(
            k: int,
            total: int | None = None,
            batch: dict[str, torch.Tensor] = batch,
            what: str = what,
        ) -> tuple[Capture, int]:
            # How far: the operators recorded so far (the second capture records as many)
            graphs: list[fx.Graph] = []
            with ticking(
                tick,
                f"capturing the {what} ({k} of 2)",
                functools.partial(_last_size, graphs),
                total=total,
            ) as ticked:
                c = capture(
                    recipe, sandbox, slots, hypers, batch, recipe.step, train=True, what=what,
                    on_graph=graphs.append,
                )  # fmt: skip
            return c, ticked.done

        first, recorded = once(1)
        if zero_grads and first.dropped & grads:
            raise _GradientsDropped
        segments = max(segments, first.checkpointed)
        second, _ = once(2, recorded or None)
        graphs: list[fx.Graph] = []  # how far: the functional graph's operators so far
        with ticking(
            tick,
            f"comparing the captures, making the {what} functional",
            functools.partial(_last_size, graphs),
        ):
            bound = bind(
                first, second, slots=slots, hypers=hypers, batch_keys=list(batch),
                train=True, what=what, on_graph=graphs.append,
            )  # fmt: skip
        train.append((bound, batch_signature(batch)))
    fns = read_only_entries(recipe)
    evals: dict[str, _Bound] = {}
    for name, fn in fns.items():
        progs = []
        for i, batch in enumerate(batches):
            what = step_label(f"{name} step", i, len(batches))
            tick(f"capturing the {what} (twice)", 0, None)
            a, b = (
                capture(recipe, sandbox, slots, [], batch, fn, train=False, what=what)
                for _ in range(2)
            )
            bound = bind(
                a, b, slots=slots, hypers=[], batch_keys=list(batch), train=False, what=what
            )
            progs.append((bound, batch_signature(batch)))
        evals[name] = progs
    return slots, train, evals, segments


def _serialize(bound: BoundProgram, what: str, tick: Ticker = no_ticks) -> Lowered:
    """The program as a checked portable artifact."""
    try:
        data = lower(
            bound.graph, tick=lambda done, total: tick(f"lowering the {what}", done, total)
        )
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
            return Lowered(attempt.portable_artifact(target), target, text)
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
    check: bool | None = None,
    ticker: Ticker | None = None,
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
      ticker: called as the export moves through its stages, with how far it is
        (``stepbundle.frontend.progress``; the CLI draws it as a progress line).
      check: after writing, step the bundle once on the CPU through the runtime (in a
        child process) and the recipe once eagerly on a copy, and refuse when a metric
        or state tensor differs beyond float32 rounding (``stepbundle.frontend.step_check``).
        False skips it (a model too big to step on this machine's CPU); None (the
        default): on, unless the environment sets ``STEPBUNDLE_EXPORT_CHECK=0`` or the
        model is on the meta device (a weights-free export of a model built there: the
        export line says the check was skipped and why).

    A weights-free export (``include_state=False``) copies no state and traces on fake
    tensors: the recipe may build its model on the meta device (``with
    torch.device("meta"): model = ...``), computing its non-persistent buffers (rotary
    tables) on the CPU after; docs/exporting.md says how.

    Raises:
      ExportError: the step cannot be replayed faithfully; the message says why.
      MetaTensorError: the model is on the meta device and the bundle would need its
        values (``include_state=True``, a non-persistent buffer on meta, ``check=True``).
      CheckFailed: the check found the bundle's step computing something else (the
        bundle is removed); an ``ExportError``.
    """
    # The check's runtime process starts now and imports the runtime while the step is
    # captured (``runtime_ahead``); a model on the meta device is not checked.
    ahead = check_wanted(check) and isinstance(recipe, Recipe) and not _on_meta(recipe)
    with runtime_ahead(ahead) as runtime:
        return _export(
            recipe,
            path,
            mlir_dir=mlir_dir,
            progress=progress,
            check=check,
            ticker=ticker,
            runtime=runtime,
        )


def _on_meta(recipe: Recipe) -> bool:
    return any(t.is_meta for t in recipe.model.state_dict(keep_vars=True).values())


def _export(
    recipe: Recipe,
    path: str | os.PathLike[str],
    *,
    mlir_dir: str | os.PathLike[str] | None,
    progress: Callable[[str], None] | None,
    check: bool | None,
    ticker: Ticker | None,
    runtime: RuntimeStep | None,
) -> ExportReport:
    """``export``'s body; ``runtime``: the check's runtime process, started ahead."""
    say = progress or (lambda _msg: None)
    tick = ticker or no_ticks
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
    on_meta = _on_meta(recipe)
    if on_meta and check:
        raise MetaTensorError(
            "check=True steps the recipe's model once eagerly, and its tensors are on the "
            "meta device (no values). Pass check=False (stepbundle export --no-check), or "
            "export a materialized model."
        )
    base_seed = torch.initial_seed() if recipe.seed is None else int(recipe.seed)
    if not 0 <= base_seed < 2**64:
        raise ExportError(f"Recipe.seed must be in [0, 2**64), got {base_seed}.")
    batches = [
        {k: v.cpu() for k, v in checked_batch(b, f"example batch {i}").items()}
        for i, b in enumerate(recipe.all_batches())
    ]
    hypers = _hyperparameters(recipe)
    for zero_grads in (True, False):
        try:
            slots, train_bound, eval_bound, segments = _trace(
                recipe, hypers, batches, zero_grads=zero_grads, say=say, tick=tick
            )
            break
        except _GradientsDropped:
            continue
    say(
        f"captured: {2 * len(batches)} training steps"
        + (
            f", {counted(len(eval_bound), 'read-only entry', 'read-only entries')}"
            if eval_bound
            else ""
        )
        + f"; {counted(len(slots), 'state tensor')}"
        + (
            f"; {counted(segments, 'checkpointed segment')} a step, "
            "each recomputed in the backward (torch.utils.checkpoint)"
            if segments
            else ""
        )
    )
    times["trace"] = time.perf_counter() - t0

    entries = {
        name: [
            ProgramDraft(
                b.inputs, b.outputs, sig, functools.partial(_serialize, b, tick=tick),
                eval_modules=b.eval_modules,
            )
            for b, sig in progs
        ]
        for name, progs in [("train", train_bound), *eval_bound.items()]
    }  # fmt: skip
    report = write_bundle(
        recipe,
        path,
        state=[(s, s.value) for s in slots],
        entries=entries,
        hyperparameters={h.name: h.value for h in hypers},
        producer=producer(NO_TORCH_XLA),
        rng=lambda: (Rng(seed=base_seed), ()),
        metadata=metadata,
        numerics="pytorch",
        matmul_precision=_matmul_precision(
            [b for progs in (train_bound, *eval_bound.values()) for b, _ in progs], say
        ),
        notes=notes,
        mlir_dir=mlir_dir,
        say=say,
        times=times,
    )
    close = getattr(ticker, "close", None)
    if callable(close):  # the last stage's line ends before the check's lines
        close()
    if on_meta and check is None:
        say(
            "check skipped: the model is on the meta device (no values to step eagerly); "
            "step the bundle from a checkpoint (stepbundle run --init-from) to try it"
        )
    elif not on_meta and check_wanted(check):
        t1 = time.perf_counter()
        # a stage of its own: it starts the runtime in a child and steps the model
        tick(CHECK_STAGE, 0, None)
        # A step with random numbers: its draws replayed from the program's own lowering.
        replay = replaying(draws_of(train_bound[0][0].graph.gm))
        report.check = check_bundle(
            recipe, report.path, report.manifest, random_reference=replay, say=say,
            runtime=runtime,
        )  # fmt: skip
        if callable(close):
            close()
        if not report.check.ran:
            say(report.check.line())
        times["check"] = time.perf_counter() - t1
    elif not check_wanted(check):
        say(UNCHECKED)
    return report
