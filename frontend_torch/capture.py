"""Capture one call of the user's step as a functional aten graph.

``make_fx`` traces a function that installs tracer tensors as the model's parameters,
buffers, gradients, optimizer state and declared hyperparameters (``state.Sandbox``) and
runs the user's ordinary step. It records at torch's dispatcher, below autograd, so the
graph holds the forward, the backward and the optimizer's in-place updates. A second
``make_fx`` over that graph under ``torch.func.functionalize`` turns every in-place
update into a value plus a final ``copy_`` into the input it writes.

While tracing, ``torch.compiler.is_compiling()`` answers True, as it does under
``torch.compile``: ``torch.optim`` then keeps Adam's step count a tensor and skips its
device checks for ``capturable=True``, so both Adam settings give one graph whose bias
correction is computed from the step-count input. A value the step reads on the host
(``.item()`` feeding an operator) stays a 0-d tensor in the graph; a Python decision on
one (``if loss > 0``) cannot be captured and is refused.

The training step runs with each module in the mode the user left it in (a frozen
BatchNorm in eval mode), as ``stepbundle.exporter`` traces it; read-only entries run
under ``model.eval()``.

Imports: torch, stepbundle.schema, stepbundle.exporter's torch_xla-free modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import fx
from torch._decomp import core_aten_decompositions, get_decompositions
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from stepbundle.frontend.errors import ExportError
from stepbundle.frontend.recipe import Recipe
from stepbundle.frontend.step_io import checked_metrics, hyperparameter_values
from stepbundle.schema.manifest import StateKind

from . import graph as g
from .remat import recompute_behind_barriers
from .state import Sandbox, Slot

__all__ = ["Capture", "Functional", "Hyper", "capture", "functional"]

aten = torch.ops.aten

# Decomposed while the step runs: native_batch_norm's schema does not declare that it
# writes the running statistics, so functionalization would drop the writes; its
# decomposition makes them with copy_. (Everything else is decomposed afterwards, once:
# decomposing is most of the cost of a capture, and the second capture of a step only
# has to show that the step did the same thing.)
DURING_STEP: dict[Any, Callable[..., Any]] = get_decompositions(
    [
        aten.native_batch_norm,
        aten._native_batch_norm_legit,
        aten._native_batch_norm_legit_no_training,
        aten._native_batch_norm_legit_functional,
    ]
)
# The core aten set, and these operators too: their kernels are what the lowering would
# otherwise reimplement, and torch's own decompositions compute them the way its kernels
# do (float32 statistics for half types).
DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    **core_aten_decompositions(),
    **DURING_STEP,
    **get_decompositions(
        [
            aten.native_layer_norm,
            aten.native_group_norm,
            aten.native_dropout,
            aten._adaptive_avg_pool2d,
            aten._adaptive_avg_pool2d_backward,
        ]
    ),
}
# Kept whole: scaled_dot_product_attention's forward (its backward is kept already), so
# that the lowering writes attention as one named operation a TPU runtime can swap for
# fused kernels (aten_nn.py, stablehlo/attention_composite.py).
del DECOMPOSITIONS[aten._scaled_dot_product_flash_attention_for_cpu.default]


@dataclass(frozen=True)
class Hyper:
    """A declared hyperparameter: its bundle name, where it lives (param group, key, and
    the element of a tuple setting such as ``betas``, or None), its value at export."""

    name: str
    group: int
    key: str
    value: float
    index: int | None = None

    def held(self, optimizer: torch.optim.Optimizer) -> Any:
        """What ``param_groups`` holds in this hyperparameter's place now."""
        v = optimizer.param_groups[self.group].get(self.key)
        if self.index is None:
            return v
        return v[self.index] if isinstance(v, (tuple, list)) and len(v) > self.index else None


@dataclass(frozen=True)
class Capture:
    """One captured call of a step, as the step ran it (not yet functional).

    Attributes:
      gm: the graph. Its placeholders are, in order, one per state slot, one per declared
        hyperparameter, one per batch key; its outputs are the metrics, then the value
        after the step of every slot that still exists (``finals``).
      example: the example inputs it was captured with (for ``functional``).
      metric_names: the metrics, in output order.
      finals: the slots whose value after the step is an output, in output order.
      replaced: slots that hold another tensor object after the step than before (a
        gradient rebuilt by backward after ``zero_grad(set_to_none=True)``).
      dropped: slots the step set to None (gradients).
      text: the graph as text, for comparing two captures.
      constants: tensors the step captured from Python (graph attributes), by name.
      hyper_values: the scalar settings of ``param_groups`` before the step, for messages.
      eval_modules: the modules in eval mode when the step returned (``Entry.eval_modules``).
      checkpointed: the ``torch.utils.checkpoint`` segments the step ran, each recomputed
        in the backward behind a barrier (``remat.py``).
    """

    gm: fx.GraphModule
    example: tuple[torch.Tensor, ...]
    metric_names: tuple[str, ...]
    finals: tuple[str, ...]
    replaced: frozenset[str]
    dropped: frozenset[str]
    text: str
    constants: Mapping[str, torch.Tensor]
    hyper_values: tuple[tuple[str, float], ...]
    eval_modules: tuple[str, ...] = ()
    checkpointed: int = 0


def _needs_fake(t: torch.Tensor) -> bool:
    # A meta tensor (a model built on meta) or one element expanded (made state of a
    # weights-free export, state.described): the step writes such inputs in place, so
    # the tracer gets a dense fake tensor of the same shape, on the CPU.
    return t.is_meta or (t.numel() > 1 and 0 in t.stride())


def traceable(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``values`` as ``make_fx`` inputs: each meta or expanded tensor replaced by a dense
    fake CPU tensor of its shape and dtype (one ``FakeTensorMode`` for all, made as
    ``make_fx(tracing_mode="fake")`` makes its own, which then traces in it); the others
    as they are, so that an export with weights traces exactly as before."""
    if not any(_needs_fake(v) for v in values):
        return values
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
        mode = FakeTensorMode(
            allow_fallback_kernels=True,
            allow_non_fake_inputs=True,
            shape_env=ShapeEnv(),
            static_shapes=True,
        )
    out = []
    for v in values:
        if _needs_fake(v):
            with mode:
                out.append(torch.empty(tuple(v.shape), dtype=v.dtype, device="cpu"))
        else:
            out.append(mode.from_tensor(v))
    return out


@contextmanager
def _as_if_compiling() -> Any:
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        yield


def _refusal(e: BaseException, what: str) -> ExportError | None:
    """The ExportError for a tracer failure that means the step cannot be one graph."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(e, DynamicOutputShapeException):
        return ExportError(
            f"The {what} calls {e.func}, whose output shape depends on the values of its "
            "input (nonzero, boolean masking, unique...). One program has one shape per "
            "tensor, so the step cannot be exported. Replace it with static-shape ops "
            "(torch.where, masked sums) and export again."
        )
    if isinstance(e, (GuardOnDataDependentSymNode, DataDependentOutputException)):
        return ExportError(
            f"The {what} makes a Python decision on a tensor's value (a Python `if` on a "
            "tensor, float(t) or .item() in a condition, print(t)), which a bundle would "
            "freeze at the value of the traced step. Keep the decision on the device "
            "(torch.where instead of `if`, return tensors as metrics) and export again. "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        )
    return None


def capture(
    recipe: Recipe,
    sandbox: Sandbox,
    slots: list[Slot],
    hypers: list[Hyper],
    batch: Mapping[str, torch.Tensor],
    fn: Callable[..., Any],
    *,
    train: bool,
    what: str,
    on_graph: Callable[[fx.Graph], None] | None = None,
) -> Capture:
    """Capture one call of ``fn`` (the training step, or a read-only entry) as a graph.

    The graph records what the step ran; ``functional`` makes it a program.
    ``on_graph``, if given, receives the graph while it is being recorded, before the
    step runs (its node count is how far the capture is: ``export.py``'s progress line).

    ``recipe``'s model and optimizer hold tracer tensors (through ``sandbox``) only while
    ``fn`` runs; the caller restores them (``Sandbox.restore``) after its last capture, so
    that what a step changes in Python (a learning rate in ``param_groups``) is seen by
    the next capture, as by the next eager step.
    """
    batch_keys = list(batch)
    n_state, n_hyper = len(slots), len(hypers)
    info: dict[str, Any] = {}

    def pure(*flat: torch.Tensor) -> list[torch.Tensor]:
        if on_graph is not None and (mode := get_proxy_mode()) is not None:
            on_graph(mode.tracer.graph)
        values = {s.name: t for s, t in zip(slots, flat[:n_state])}
        hyper = {(h.group, h.key, h.index): t
                 for h, t in zip(hypers, flat[n_state : n_state + n_hyper])}  # fmt: skip
        b = dict(zip(batch_keys, flat[n_state + n_hyper :]))
        sandbox.install(slots, values, hyper)
        if train:
            # The modes the user left each module in, not model.train(); read back after
            # the step, which may set them itself.
            sandbox.user_modes()
            metrics = checked_metrics(fn(recipe.model, recipe.optimizer, b), what, need_loss=True)
        else:
            recipe.model.eval()
            with torch.no_grad():
                metrics = checked_metrics(fn(recipe.model, b), what, need_loss=False)
        info["eval_modules"] = sandbox.eval_modules()
        after = sandbox.read(slots)
        for h, t in zip(hypers, flat[n_state : n_state + n_hyper]):
            if h.held(recipe.optimizer) is not t:
                raise ExportError(
                    f"The {what} changed hyperparameter {h.name!r} itself (a "
                    "scheduler.step() inside the step?). A declared hyperparameter is set by "
                    "the runtime on every step: drive it with trainer.set_hyperparameter or "
                    "a schedule (stepbundle run --lr-schedule) and remove the change from "
                    "the step."
                )
        installed = dict(zip((s.name for s in slots), flat[:n_state]))
        finals = [s.name for s in slots if after[s.name] is not None]
        info["metric_names"] = tuple(metrics)
        info["finals"] = tuple(finals)
        info["dropped"] = frozenset(s.name for s in slots if after[s.name] is None)
        info["replaced"] = frozenset(
            s.name
            for s in slots
            if s.kind is not StateKind.PARAMETER
            and after[s.name] is not None
            and after[s.name] is not installed[s.name]
        )
        outs = [*metrics.values()]
        for name in finals:
            final = after[name]
            assert final is not None
            outs.append(final.detach())
        return outs

    flat = traceable([s.value for s in slots])
    flat += [torch.tensor(h.value, dtype=torch.float32) for h in hypers]
    flat += [batch[k] for k in batch_keys]
    hyper_values = hyperparameter_values(recipe.optimizer)
    rng = torch.random.get_rng_state()
    try:
        with _as_if_compiling(), recompute_behind_barriers() as segments:
            first = make_fx(
                pure,
                tracing_mode="fake",
                decomposition_table=DURING_STEP,
                _allow_non_fake_inputs=True,
            )(*flat)
    except ExportError:
        raise
    except Exception as e:
        refusal = _refusal(e, what)
        if refusal is None:
            raise
        raise refusal from e
    finally:
        sandbox.uninstall()
        sandbox.user_modes()
        torch.random.set_rng_state(rng)
    return Capture(
        gm=first,
        example=tuple(flat),
        metric_names=info["metric_names"],
        finals=info["finals"],
        replaced=info["replaced"],
        dropped=info["dropped"],
        text=g.graph_text(first),
        constants=g.constants(first),
        hyper_values=hyper_values,
        eval_modules=info["eval_modules"],
        checkpointed=segments[0],
    )


@dataclass(frozen=True)
class Functional:
    """A capture made functional and decomposed to the core aten set.

    Attributes:
      gm: the graph: placeholders and outputs as the capture's, no in-place operator.
      writes: placeholder index -> the value the step wrote into that input in place.
    """

    gm: fx.GraphModule
    writes: Mapping[int, fx.Node]


def functional(
    c: Capture, what: str, on_graph: Callable[[fx.Graph], None] | None = None
) -> Functional:
    """The capture without in-place updates: each becomes a value and an input write.
    ``on_graph``: as ``capture``'s, for the graph this records."""
    pure = torch.func.functionalize(c.gm, remove="mutations_and_views")

    def recorded(*args: Any) -> Any:
        if on_graph is not None and (mode := get_proxy_mode()) is not None:
            on_graph(mode.tracer.graph)
        return pure(*args)

    gm = make_fx(
        recorded,
        tracing_mode="fake",
        decomposition_table=DECOMPOSITIONS,
        _allow_non_fake_inputs=True,
    )(*c.example)
    g.strip_profiler(gm)
    for node in gm.graph.nodes:
        meta = node.meta.get("val")
        if isinstance(meta, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in meta.shape):
            raise ExportError(
                f"The {what} calls {node.target}, whose output shape depends on the values of "
                "its input (nonzero, boolean masking, unique...). One program has one shape "
                "per tensor, so the step cannot be exported. Replace it with static-shape ops "
                "(torch.where, masked sums) and export again."
            )
    try:
        writes = g.split_mutations(gm)
    except ValueError as e:
        raise ExportError(
            f"The {what} writes to a tensor that is not part of the training state ({e}): "
            "a tensor the step captured from Python, or one made outside the model and the "
            "optimizer. A bundle keeps only the state it knows; register the tensor as a "
            "buffer (module.register_buffer) or stop writing to it."
        ) from e
    return Functional(gm, writes)
