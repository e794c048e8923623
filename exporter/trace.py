"""Run the user's step once under torch_xla's lazy tracer and record its graph.

One ``StepTrace`` says, for every input of the lowered graph, which tensor it came
from (by torch_xla tensor id, read after a sync and before the step), and for every
output, which metric or state tensor it is. ``bind.py`` turns two consecutive traces
into a binding table.

Imports: torch; torch_xla through ``xla.py`` only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stepbundle.frontend.errors import ExportError
from stepbundle.frontend.step_io import checked_metrics, hyperparameter_values
from stepbundle.schema.manifest import StateKind

from . import xla
from .attention_composites import sdpa_composites
from .host_reads import guard_host_reads
from .modes import eval_batchnorm
from .optimizers import traced_optimizer
from .segments import counting_checkpoints
from .workspace import StateTensor, Workspace

__all__ = ["InputOrigin", "StepTrace", "trace_eval", "trace_train"]


@dataclass(frozen=True)
class InputOrigin:
    """What one graph input is, as seen by the tracer.

    kind: "state" | "batch" | "rng_seed" | "hyperparameter" | "host"
    ("host": a host scalar or a temporary made inside the step; a constant candidate).
    """

    kind: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    value: torch.Tensor | None  # CPU copy, for "host" and "rng_seed" inputs only


@dataclass(frozen=True)
class StepTrace:
    """One traced call of a step.

    Attributes:
      text: the lowered StableHLO, as text (compared between traces).
      bytecode: the lowered StableHLO as torch_xla serialized it.
      inputs: origin of each graph input, in parameter order.
      metric_names: names of the metric outputs, in output order (first outputs).
      updated_state: names of the state tensors written, in output order, after the
        metrics.
      metric_specs / update_specs: (dtype, shape) of each output.
      hyper_values: hyperparameter-like values of the param_groups before the step,
        for error messages.
      eval_modules: the modules in eval mode when the step returned (``Entry.eval_modules``).
      ir: torch_xla's IR of the graph with source locations, recorded only under
        ``xla.ir_debug()`` (to explain a graph that changed, ``graphdiff.py``); else "".
    """

    text: str
    bytecode: bytes
    inputs: tuple[InputOrigin, ...]
    metric_names: tuple[str, ...]
    metric_specs: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    updated_state: tuple[str, ...]
    update_specs: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    hyper_values: tuple[tuple[str, float], ...]
    eval_modules: tuple[str, ...] = ()
    ir: str = ""


def _check_no_host_round_trip(before: dict[str, int], after: dict[str, int], what: str) -> None:
    """Refuse a step that ran part of itself eagerly: it cannot be captured as one graph."""
    trips = xla.round_trips(before, after)
    if trips.cpu_ops:
        ops = ", ".join(trips.cpu_ops)
        raise ExportError(
            f"The {what} ran op(s) {ops} on the CPU: torch_xla has no XLA lowering for "
            "them (data-dependent output shapes, such as nonzero or boolean masking, are "
            "the usual cause). A graph with a CPU round trip cannot be replayed. Replace "
            "them with static-shape ops (torch.where, masked sums) and export again."
        )
    if trips.host_reads:
        raise ExportError(
            f"The {what} read a device value on the host in the middle of the step "
            "(.item(), float(t), print(t), a Python `if` on a tensor, or a tensor "
            "passed where torch wants a number). That splits the step into several "
            "graphs whose host-side decisions would be frozen into the bundle. Keep "
            "the values on the device (torch.where instead of `if`, return tensors as "
            "metrics instead of calling .item()) and export again."
        )


def _refuse_torch_checkpoint(e: AttributeError) -> None:
    """torch.utils.checkpoint cannot run on XLA (it looks up ``torch.xla``, which does not
    exist): say so, and point to torch_xla's checkpoint, instead of torch's traceback."""
    tb = e.__traceback__
    inside = False
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            inside = True
        tb = tb.tb_next
    if inside and "'xla'" in str(e):
        raise ExportError(
            f"The training step uses torch.utils.checkpoint, which fails on XLA devices "
            f"({e}). Use torch_xla's activation checkpointing instead: "
            "torch_xla.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)."
        ) from e


def _origins(
    ids: list[int],
    values: list[torch.Tensor],
    *,
    state_ids: Mapping[int, str],
    batch_ids: Mapping[int, str],
    hyper_ids: Mapping[int, str],
) -> tuple[InputOrigin, ...]:
    seed_id = xla.seed_input_id()
    out = []
    for tid, v in zip(ids, values):
        dtype, shape = v.dtype, tuple(int(d) for d in v.shape)
        if tid in state_ids:
            out.append(InputOrigin("state", state_ids[tid], dtype, shape, None))
        elif tid in batch_ids:
            out.append(InputOrigin("batch", batch_ids[tid], dtype, shape, None))
        elif tid in hyper_ids:
            out.append(InputOrigin("hyperparameter", hyper_ids[tid], dtype, shape, None))
        elif tid == seed_id:
            out.append(InputOrigin("rng_seed", "rng_seed", dtype, shape, v.cpu().clone()))
        else:
            out.append(InputOrigin("host", "", dtype, shape, v.cpu().clone()))
    return tuple(out)


def _on_device(states: list[StateTensor]) -> list[StateTensor]:
    """The state tensors on the XLA device.

    State an optimizer keeps on the host (a non-capturable Adam's step count) has no
    torch_xla id: it enters the graph as a number, which ``bind`` compares between the
    two traced steps (and refuses, naming it, when it changes).
    """
    return [s for s in states if s.tensor.device.type == "xla"]


def _ids_of(states: list[StateTensor]) -> dict[str, int]:
    return {s.name: xla.tensor_id(s.tensor) for s in _on_device(states)}


def _values_of(states: list[StateTensor]) -> dict[str, xla.TensorValue]:
    """What each state tensor on the device holds: its device buffer or its pending node.

    A tensor id does not tell: in-place updates such as BatchNorm's running statistics
    keep the id and only replace the graph node behind it.
    """
    on_device = _on_device(states)
    return dict(zip((s.name for s in on_device), xla.tensor_values([s.tensor for s in on_device])))


def _own_buffers(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of the batch tensors that each get a device buffer of their own (at the
    next sync).

    torch_xla hands out one shared buffer for equal scalars uploaded from the host, so
    two 0-dim batch inputs with equal example values would be one graph input, bound
    to one name, and the other input would be silently ignored at run time.
    """
    return {k: v.clone() for k, v in batch.items()}


def trace_train(
    ws: Workspace,
    batch: Mapping[str, torch.Tensor],
    step_fn: Any,
    *,
    seed: int | None = None,
    run: bool = False,
) -> StepTrace:
    """Trace one training step on the workspace (and run it, with ``run``:
    ``export_running_traced_steps(run_traced_steps=True)``).

    Running it leaves the workspace in the state after the step, as in eager training
    with one sync per step. Not running it (compiling the step was almost all of export
    time) leaves a placeholder in every state tensor the step changed (``xla.skip_step``),
    which the next traced step reads as a graph input just the same. ``seed``, when
    given, is the torch_xla RNG seed this step receives (every sync advances it).
    """
    batch = _own_buffers(batch)
    xla.sync()
    if seed is not None:
        xla.set_rng_state(seed)
    states = ws.state_tensors()
    before = _ids_of(states)
    state_ids = {tid: name for name, tid in before.items()}
    obj_before = {s.name: s.tensor for s in states}
    names_before = [s.name for s in states]
    value_before = _values_of(states)
    batch_ids = {xla.tensor_id(t): k for k, t in batch.items()}
    hyper_before = {name: xla.tensor_id(t) for name, t in ws.hyperparameters.items()}
    hyper_ids = {tid: name for name, tid in hyper_before.items()}
    hvals = hyperparameter_values(ws.optimizer)
    counters = xla.counters()
    # The modes the user left each module in, not model.train(): a frozen BatchNorm or a
    # dropout turned off stays so. The modes are read back after the step, which may set
    # them itself (model.train() at its top).
    ws.user_modes()
    # torch_xla cannot differentiate eval-mode BatchNorm; torch.optim keeps step counts
    # tensors only when it believes it is compiling (exporter/optimizers.py).
    # Tracing again to explain a changed graph (xla.ir_debug()): no Python modes, whose
    # frames would stand where torch_xla records each op's source location.
    plain = xla.ir_debugging()
    try:
        with (
            contextlib.nullcontext() if plain else eval_batchnorm(),
            contextlib.nullcontext() if plain else sdpa_composites(),
            traced_optimizer(ws.optimizer),
            contextlib.nullcontext() if plain else guard_host_reads("training step"),
            counting_checkpoints(),
        ):
            result = step_fn(ws.model, ws.optimizer, dict(batch))
    except AttributeError as e:
        _refuse_torch_checkpoint(e)
        raise
    eval_modules = ws.eval_modules()
    _check_no_host_round_trip(counters, xla.counters(), "training step")
    metrics = checked_metrics(result, "training step", need_loss=True, device_type="xla")

    replaced = ws.replaced_hyperparameters()
    for name, t in ws.hyperparameters.items():
        if xla.tensor_id(t) != hyper_before[name] or name in replaced:
            raise ExportError(
                f"The training step changed hyperparameter {name!r} itself (a "
                "scheduler.step() inside the step?). A declared hyperparameter is set by "
                "the runtime on every step: drive it with trainer.set_hyperparameter or "
                "a schedule (stepbundle run --lr-schedule) and remove the change from the "
                "step."
            )
    after = ws.state_tensors()
    after_names = {s.name for s in after}
    vanished = [n for n in names_before if n not in after_names]
    # A gradient the step created (zero_grad() dropped it, backward made it again) is
    # not new state: it is transient, like any gradient rebuilt without reading its old
    # value (below). Other state the step created is the lazily created state of an
    # optimizer stepbundle does not know.
    new_names = [
        s.name for s in after if s.name not in obj_before and s.kind is not StateKind.GRADIENT
    ]
    if new_names:
        raise ExportError(
            "The training step created new state: "
            + ", ".join(new_names[:8])
            + (" ..." if len(new_names) > 8 else "")
            + ". The first step of an optimizer stepbundle does not know lazily creates "
            "its state; take one optimizer step before exporting so that the state "
            "exists, then export."
        )
    updated: list[StateTensor] = []
    value_after = _values_of(after)
    for s in _on_device(after):
        if s.kind is StateKind.GRADIENT and s.name in vanished:
            continue
        if (
            obj_before.get(s.name) is not s.tensor
            or xla.tensor_id(s.tensor) != before.get(s.name)
            or value_after[s.name] != value_before[s.name]
        ):
            updated.append(s)
    # Gradients dropped by the step (zero_grad(set_to_none=True) at its end) are not
    # kept between steps: they are not state of the bundle.
    for n in vanished:
        if not n.endswith(".grad"):
            raise ExportError(
                f"The training step removed state tensor {n!r}. State must persist between steps."
            )

    metric_specs = [(v.dtype, tuple(int(d) for d in v.shape)) for v in metrics.values()]
    ids, values = xla.graph_inputs(list(metrics.values()) + [s.tensor for s in updated])
    # A gradient that is a new tensor after the step and whose old value the step did
    # not read was thrown away and rebuilt (zero_grad(set_to_none=True), then backward):
    # the next step throws it away again, so it is not state. Gradients zeroed in place
    # (set_to_none=False) or accumulated across steps stay the same tensor, or are read.
    read = set(int(i) for i in ids)
    transient = {
        s.name
        for s in updated
        if s.kind is StateKind.GRADIENT
        and obj_before.get(s.name) is not s.tensor
        and before.get(s.name) not in read
    }
    changed = {s.name for s in updated}
    if transient:
        updated = [s for s in updated if s.name not in transient]
    roots: list[torch.Tensor] = list(metrics.values()) + [s.tensor for s in updated]
    text, bytecode = xla.lower(roots)
    if transient:
        ids, values = xla.graph_inputs(roots)
    inputs = _origins(
        list(ids),
        list(values),
        state_ids=state_ids,
        batch_ids=batch_ids,
        hyper_ids=hyper_ids,
    )
    missing_hp = [
        n
        for n in ws.hyperparameters
        if n not in {i.name for i in inputs if i.kind == "hyperparameter"}
    ]
    if missing_hp:
        raise ExportError(
            f"Hyperparameter(s) {', '.join(map(repr, missing_hp))} were declared but the "
            "traced step does not read them as tensors, so setting them would change "
            "nothing. The optimizer must use the param_groups value inside its update; "
            "remove the declaration or use an optimizer that accepts a tensor value."
        )
    trace = StepTrace(
        text=text,
        bytecode=bytecode,
        inputs=inputs,
        metric_names=tuple(metrics),
        metric_specs=tuple(metric_specs),
        updated_state=tuple(s.name for s in updated),
        update_specs=tuple(
            (s.tensor.dtype, tuple(int(d) for d in s.tensor.shape)) for s in updated
        ),
        hyper_values=hvals,
        eval_modules=eval_modules,
        ir=xla.ir_text(roots) if xla.ir_debugging() else "",
    )
    del roots, metrics, result, values
    if run:
        xla.sync()
    else:
        # Everything the step changed on the device gets a placeholder, gradients
        # rebuilt by the step (transient) too, and gradients the step set to None
        # (zero_grad(set_to_none=True) at its end): backward had accumulated into them
        # in place before, and the records of the state before the step still hold them,
        # so skip_step would find them pending and run the whole step (compiling it: far
        # more time and memory than the same step with zero_grad() first, issue #40). A step that also writes the user's own device tensors is run
        # instead, as torch_xla eager would (see skip_step).
        dropped = [
            t for n in vanished if n.endswith(".grad") and (t := obj_before[n]).device.type == "xla"
        ]
        if xla.skip_step([s.tensor for s in _on_device(after) if s.name in changed] + dropped):
            xla.sync()
    return trace


def trace_eval(
    ws: Workspace, batch: Mapping[str, torch.Tensor], eval_fn: Any, what: str
) -> StepTrace:
    """Trace a read-only step (model.eval(), no grad). Nothing is executed."""
    batch = _own_buffers(batch)
    xla.sync()
    states = ws.state_tensors()
    before = _ids_of(states)
    value_before = _values_of(states)
    state_ids = {tid: name for name, tid in before.items()}
    batch_ids = {xla.tensor_id(t): k for k, t in batch.items()}
    counters = xla.counters()
    ws.model.eval()
    try:
        plain = xla.ir_debugging()  # as in trace_train
        with (
            torch.no_grad(),
            contextlib.nullcontext() if plain else sdpa_composites(),
            contextlib.nullcontext() if plain else guard_host_reads(what),
        ):
            result = eval_fn(ws.model, dict(batch))
        eval_modules = ws.eval_modules()
        _check_no_host_round_trip(counters, xla.counters(), what)
        metrics = checked_metrics(result, what, need_loss=False, device_type="xla")
        after = _on_device(ws.state_tensors())
        now = _values_of(after)
        changed = [
            s.name
            for s in after
            if xla.tensor_id(s.tensor) != before.get(s.name)
            or now[s.name] != value_before.get(s.name)
        ]
        if changed:
            raise ExportError(
                f"The {what} changed state ({', '.join(changed[:5])}); read-only entries "
                "must not. Run it under model.eval() and torch.no_grad(), or make it a "
                "training step."
            )
        roots = list(metrics.values())
        text, bytecode = xla.lower(roots)
        ids, values = xla.graph_inputs(roots)
        inputs = _origins(
            list(ids), list(values), state_ids=state_ids, batch_ids=batch_ids, hyper_ids={}
        )
        return StepTrace(
            text=text,
            bytecode=bytecode,
            inputs=inputs,
            metric_names=tuple(metrics),
            metric_specs=tuple((v.dtype, tuple(int(d) for d in v.shape)) for v in roots),
            updated_state=(),
            update_specs=(),
            hyper_values=(),
            eval_modules=eval_modules,
            ir=xla.ir_text(roots) if xla.ir_debugging() else "",
        )
    finally:
        ws.user_modes()
