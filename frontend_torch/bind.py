"""Turn two captures of a step into one program and its binding tables.

The captured graph's placeholders are the binding by construction: placeholder ``i`` is
state slot ``i``, a declared hyperparameter, or a batch input. What is left to decide:
which inputs the step reads (only those become program inputs), which state it writes
(a trailing ``copy_`` into the input, or a new tensor object in the slot), and whether
Python values baked into the graph are the same in two consecutive steps (the graph
texts and the captured tensor constants must be identical; a learning rate a
scheduler changes inside the step is the usual cause, and it is named).

Imports: torch, stepbundle.schema, stepbundle.exporter's torch_xla-free modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from stepbundle.frontend.dtypes import spec_of, tensor_bytes
from stepbundle.frontend.errors import ExportError
from stepbundle.frontend.tables import STATE_INPUT_KIND, state_update
from stepbundle.schema.manifest import (
    BatchInput,
    HyperparameterInput,
    InputBinding,
    MetricOutput,
    OutputBinding,
    RngSeedInput,
    StateInput,
    StateKind,
    TensorSpec,
)

from . import graph as g
from .capture import Capture, Hyper, functional
from .lowering import ProgramGraph
from .state import Slot

__all__ = ["BoundProgram", "bind"]


@dataclass(frozen=True)
class BoundProgram:
    """A program's binding tables and the graph to lower for it; ``eval_modules`` the
    modules the step ran in eval mode (``Entry.eval_modules``)."""

    inputs: tuple[InputBinding, ...]
    outputs: tuple[OutputBinding, ...]
    graph: ProgramGraph
    eval_modules: tuple[str, ...] = ()


def _spec(node: Any, what: str) -> TensorSpec:
    meta = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(meta, torch.Tensor):
        raise ExportError(f"{what} is not a tensor the step computed ({node!r}).")
    return spec_of(meta.dtype, tuple(int(d) for d in meta.shape), what)


def _changed_setting(a: Capture, b: Capture) -> list[str]:
    """The optimizer settings that changed between two captures, as sentences."""
    after = dict(b.hyper_values)
    out = []
    for label, xa in a.hyper_values:
        xb = after.get(label)
        if xb is not None and xb != xa:
            key = label.split("'")[1]
            out.append(
                f"The optimizer's {label} changed from {xa!r} to {xb!r} between the steps "
                "(a learning-rate scheduler, or other code that edits param_groups). "
                f"Declare it: Recipe(hyperparameters=({key!r},)), and set it from the "
                "runtime (trainer.set_hyperparameter, or stepbundle run --lr-schedule) "
                "instead of inside the step."
            )
    return out


def _fmt(t: torch.Tensor) -> str:
    if t.numel() == 1:
        return str(t.detach().double().reshape(()).item())
    return f"{t.dtype} tensor of shape {tuple(t.shape)} (sum {float(t.double().sum()):.6g})"


def _same(a: Capture, b: Capture, what: str) -> None:
    """Refuse two captures that would not be one program."""
    if a.text != b.text:
        named = _changed_setting(a, b)
        more = "".join(f"\n  - {h}" for h in named)
        raise ExportError(
            f"The graph of the {what} changed between two consecutive traced steps, so no "
            "single program can replay it. A Python value the step computes differently "
            "each time is baked into it (a step counter, a learning rate set inside the "
            f"step), or Python control flow depends on one. First difference, "
            f"{g.first_difference(a.text, b.text)}"
            + (f"\nWhat changed and how to fix it:{more}" if named else "")
        )
    for name, ta in a.constants.items():
        tb = b.constants[name]
        if ta.shape != tb.shape or ta.dtype != tb.dtype or tensor_bytes(ta) != tensor_bytes(tb):
            raise ExportError(
                f"The {what} captures a tensor from Python ({ta.dtype}{list(ta.shape)}) "
                f"whose value changed between two consecutive traced steps: {_fmt(ta)} in "
                f"step 1, {_fmt(tb)} in step 2. A bundle would freeze it at one value, so "
                "the export is refused. Make it a tensor the step reads from the model, the "
                "optimizer state or the batch, or declare it as a hyperparameter."
            )
    if (a.metric_names, a.finals, a.replaced, a.dropped) != (
        b.metric_names,
        b.finals,
        b.replaced,
        b.dropped,
    ):
        raise ExportError(
            f"The {what} returned different metrics or changed different state in two "
            f"consecutive steps (metrics {list(a.metric_names)} then {list(b.metric_names)}). "
            "A step must do the same work every time."
        )


def bind(
    a: Capture,
    b: Capture,
    *,
    slots: Sequence[Slot],
    hypers: Sequence[Hyper],
    batch_keys: Sequence[str],
    train: bool,
    what: str,
    on_graph: Callable[[fx.Graph], None] | None = None,
) -> BoundProgram:
    """Compare two captures of one step and build its program and binding tables.
    ``on_graph`` receives the functional graph while it is recorded (``functional``).

    Raises:
      ExportError: the captures differ, the step writes what it may not (a declared
        hyperparameter, state from a read-only entry), drops state, or changes a state
        tensor's dtype or shape.
    """
    _same(a, b, what)
    if a.eval_modules != b.eval_modules:
        raise ExportError(
            f"The {what} left different modules in eval mode in two consecutive captured "
            f"steps ({list(a.eval_modules)[:5]} then {list(b.eval_modules)[:5]}). Set the "
            "modes the same way every step (model.train(), then .eval() on the frozen "
            "modules)."
        )
    f = functional(b, what, on_graph)
    gm = f.gm
    ph = g.placeholders(gm)
    n_state, n_hyper = len(slots), len(hypers)
    for i in f.writes:
        if n_state <= i < n_state + n_hyper:
            h = hypers[i - n_state]
            raise ExportError(
                f"The {what} writes to hyperparameter {h.name!r} in place. A declared "
                "hyperparameter is set by the runtime on every step; remove the change "
                "from the step."
            )
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    outs = list(out_node.args[0])
    metric_nodes = outs[: len(b.metric_names)]
    final_of = dict(zip(b.finals, outs[len(b.metric_names) :], strict=True))
    index = {s.name: i for i, s in enumerate(slots)}

    for s in slots:
        if s.name in b.dropped and s.kind is not StateKind.GRADIENT:
            raise ExportError(
                f"The {what} removed state tensor {s.name!r}. State must persist between steps."
            )
    updated: list[tuple[Slot, fx.Node]] = []
    for s in slots:
        if s.name not in final_of:
            continue
        i = index[s.name]
        final = final_of[s.name]
        if g.canonical(final) is ph[i] and i not in f.writes:
            continue
        if s.kind is StateKind.GRADIENT and s.name in b.replaced and not g.reads_value(ph[i]):
            # A gradient thrown away and rebuilt (zero_grad(set_to_none=True), then
            # backward) is rebuilt again next step: it is not state.
            continue
        updated.append((s, final))
    if not train and updated:
        names = ", ".join(s.name for s, _ in updated[:5])
        raise ExportError(
            f"The {what} changed state ({names}); read-only entries must not. Run it under "
            "model.eval() and torch.no_grad(), or make it a training step."
        )

    # An input is read when an operator reads it, or when it is itself a metric or the new
    # value of some state.
    returned = {g.canonical(n) for n in (*metric_nodes, *(node for _, node in updated))}

    def read(i: int) -> bool:
        return ph[i] in returned or g.reads_value(ph[i])

    inputs: list[InputBinding] = []
    fed: list[int] = []
    state_input: dict[str, int] = {}
    for i, s in enumerate(slots):
        if read(i):
            state_input[s.name] = len(inputs)
            inputs.append(StateInput(STATE_INPUT_KIND[s.kind], s.name, _spec(ph[i], s.name)))
            fed.append(i)
    unread = []
    for j, h in enumerate(hypers):
        i = n_state + j
        if read(i):
            inputs.append(HyperparameterInput(h.name, _spec(ph[i], f"Hyperparameter {h.name!r}")))
            fed.append(i)
        elif train:
            unread.append(h.name)
    if unread:
        raise ExportError(
            f"Hyperparameter(s) {', '.join(map(repr, unread))} were declared but the traced "
            "step does not read them, so setting them would change nothing. The optimizer "
            "must use the param_groups value inside its update; remove the declaration or "
            "use an optimizer that accepts a tensor value."
        )
    for j, key in enumerate(batch_keys):
        i = n_state + n_hyper + j
        if read(i):
            inputs.append(BatchInput(key, _spec(ph[i], f"Batch input {key!r}")))
            fed.append(i)
    seeded = bool(g.random_nodes(gm))
    if seeded:
        inputs.append(RngSeedInput(TensorSpec(spec_of(torch.int64, (), "seed").dtype, ())))

    outputs: list[OutputBinding] = []
    for name, node in zip(b.metric_names, metric_nodes):
        outputs.append(MetricOutput(name, _spec(node, f"Metric {name!r}")))
    for s, node in updated:
        spec = _spec(node, f"State {s.name!r}")
        before = spec_of(s.value.dtype, tuple(s.value.shape), f"State {s.name!r}")
        outputs.append(state_update(s.name, spec, before, state_input.get(s.name), what))
    graph = ProgramGraph(
        gm=gm,
        inputs=tuple(fed),
        outputs=(*metric_nodes, *(node for _, node in updated)),
        seeded=seeded,
    )
    return BoundProgram(tuple(inputs), tuple(outputs), graph, b.eval_modules)
