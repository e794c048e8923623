"""Lower a captured aten graph to a StableHLO portable artifact through jax.

``evaluate`` runs the graph node by node on jax values, calling each operator's lowering
(``registry.LOWERINGS``), and holds every result to what torch's tracer computed for the
node: the same shape (a mismatch is a lowering bug and refuses the export) and the same
dtype (the result is cast to it). ``lower`` traces ``evaluate`` with ``jax.export`` and
returns the program as a portable artifact, with 64-bit types on so that int64 and
float64 tensors keep their dtypes.

Random numbers: a program with random operators has one more input, the step's seed
(int64). The program makes the key ``jax.random.key(seed, impl="threefry2x32")`` (its
data are the seed's high and low 32 bits) and random operator number ``k``, counted in
program order from 0, draws with ``jax.random.fold_in(key, k)``. So every step's random
numbers are a fixed function of the seed the runtime feeds it, the same in every run.

Imports: torch, jax, numpy, this package's lowering tables.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import fx

from . import aten_math, aten_nn, aten_reduce, aten_shape  # noqa: F401  (they fill LOWERINGS)
from .attention_masks import fold_causal_masks
from .registry import LOWERINGS, OpContext, jax_dtype

__all__ = [
    "LoweringError",
    "ProgramGraph",
    "UnsupportedOperator",
    "evaluate",
    "lower",
    "sum_before_flattening",
]

aten = torch.ops.aten

# The scalar torch reads from a 0-d tensor stays that 0-d tensor (see capture.py).
LOWERINGS[aten._local_scalar_dense.default] = lambda ctx, x: x

SEED_IMPL = "threefry2x32"
TICK_EVERY = 100  # operators between two progress ticks of a lowering


class UnsupportedOperator(Exception):
    """A graph holds an operator that has no lowering here."""

    def __init__(self, op: Any, why: str = "") -> None:
        self.op = op
        self.why = why
        super().__init__(f"{op}" + (f" ({why})" if why else ""))


class LoweringError(Exception):
    """A lowering computed a result of another shape than torch's (a bug of the lowering)."""


@dataclass(frozen=True)
class ProgramGraph:
    """What to lower: a graph, which of its placeholders are inputs, which nodes are results.

    Placeholders that are not inputs are read for their shape only (``zeros_like`` of a
    gradient that is rebuilt): they get zeros.
    """

    gm: fx.GraphModule
    inputs: tuple[int, ...]
    outputs: tuple[Any, ...]
    seeded: bool


def _meta_of(node: fx.Node) -> Any:
    return node.meta.get("val")


def _conform(value: Any, meta: Any, node: fx.Node) -> Any:
    """``value`` held to torch's result ``meta``: same shape, cast to the same dtype."""
    if isinstance(meta, torch.Tensor):
        if value is None:
            raise LoweringError(f"{node.format_node()} gave no value")
        value = jnp.asarray(value)
        shape = tuple(int(d) for d in meta.shape)
        if tuple(value.shape) != shape:
            raise LoweringError(
                f"{node.target} gave shape {tuple(value.shape)}, torch computes {shape} "
                f"({(node.format_node() or '')[:300]})"
            )
        want = jax_dtype(meta.dtype)
        return value if value.dtype == want else value.astype(want)
    if isinstance(meta, (tuple, list)):
        return tuple(
            None if m is None else _conform(v, m, node) for v, m in zip(value, meta, strict=True)
        )
    return value


def evaluate(
    graph: ProgramGraph,
    args: Sequence[Any],
    seed: Any | None,
    tick: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """The graph's results for the program inputs ``args`` (and the seed, if seeded);
    ``tick(done, total)`` is called every ``TICK_EVERY`` operators lowered."""
    gm = graph.gm
    total = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    done = 0
    env: dict[fx.Node, Any] = {}
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fed = dict(zip(graph.inputs, args, strict=True))
    for i, node in enumerate(nodes):
        if i in fed:
            env[node] = fed[i]
        else:
            meta = _meta_of(node)
            env[node] = jnp.zeros(tuple(meta.shape), jax_dtype(meta.dtype))
    key = jax.random.key(seed, impl=SEED_IMPL) if seed is not None else None
    counter = itertools.count()

    def next_key() -> Any:
        if key is None:  # pragma: no cover - ProgramGraph.seeded is set from the graph
            raise LoweringError("a random operator in a program without a seed input")
        return jax.random.fold_in(key, next(counter))

    result: list[Any] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            env[node] = jnp.asarray(_numpy(value)) if isinstance(value, torch.Tensor) else value
        elif node.op == "call_function":
            done += 1
            if tick is not None and (done % TICK_EVERY == 0 or done == total):
                tick(done, total)
            fn = LOWERINGS.get(node.target)
            if fn is None:
                raise UnsupportedOperator(node.target)
            args_, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            metas = tuple(_meta_of(a) if isinstance(a, fx.Node) else a for a in node.args)
            ctx = OpContext(_meta_of(node), next_key, name=node.name, args=metas)
            try:
                out = fn(ctx, *args_, **kwargs)
            except NotImplementedError as e:
                raise UnsupportedOperator(node.target, str(e)) from e
            env[node] = _conform(out, _meta_of(node), node)
        elif node.op == "output":
            result = [fx.node.map_arg(o, lambda n: env[n]) for o in graph.outputs]
        else:  # pragma: no cover - make_fx graphs hold no modules or methods
            raise UnsupportedOperator(node.op)
    return result


_VIEWS = (
    aten.view_copy.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
)


def sum_before_flattening(gm: fx.GraphModule) -> int:
    """Each sum over dim 0 of a (N, C) view of an (A, ..., C) tensor (A * ... = N) as the
    sum over the leading dims of the tensor itself; returns how many.

    A Linear's bias gradient on a (B, T, C) input is such a sum (autograd flattens the
    output gradient to (B*T, C)). The same float32 sum of the same values (the order is
    XLA's either way), over the shape torch_xla sums it in. Over the (B*T, C) view, XLA
    gave the 55M GPT's qkv gradient (the concatenation of the attention kernels' dq, dk,
    dv) a column-major layout on a TPU, assembled piece by piece, and summed the bias
    over it unfused; over (B, T, C) it did neither (compiled for a v5e, libtpu's estimate
    of the step 35.23 -> 33.27 ms; benchmarks/results/frontend_gap-v5e.md).
    """
    n = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.sum.dim_IntList:
            continue
        view, dims = node.args[0], node.args[1]
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if set(node.kwargs) - {"keepdim"} or not isinstance(dims, (list, tuple)):
            continue
        if any(user.op == "output" for user in node.users):
            continue  # a program output: ProgramGraph holds it by node (kept as traced)
        if not isinstance(view, fx.Node) or view.op != "call_function":
            continue
        if view.target not in _VIEWS or not isinstance(view.args[0], fx.Node):
            continue
        source = view.args[0]
        x, flat, out = _meta_of(source), _meta_of(view), _meta_of(node)
        if not all(isinstance(t, torch.Tensor) for t in (x, flat, out)):
            continue
        if flat.ndim != 2 or x.ndim < 3 or [d % 2 for d in dims] != [0]:
            continue
        if x.shape[-1] != flat.shape[1] or math.prod(x.shape[:-1]) != flat.shape[0]:
            continue
        summed = torch.empty((int(x.shape[-1]),), dtype=out.dtype, device="meta")
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(aten.sum.dim_IntList, (source, list(range(x.ndim - 1))))
            new.meta["val"] = summed
            if keepdim:
                new = gm.graph.call_function(aten.view.default, (new, [1, int(x.shape[-1])]))
                new.meta["val"] = torch.empty(tuple(out.shape), dtype=out.dtype, device="meta")
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        if not view.users:
            gm.graph.erase_node(view)
        n += 1
    if n:
        gm.recompile()
    return n


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(jnp.bfloat16)
    return t.numpy()


def program_function(
    graph: ProgramGraph, tick: Callable[[int, int], None] | None = None
) -> Callable[..., list[Any]]:
    """The program as a jax function of its inputs (the seed last, when seeded)."""

    def program(*args: Any) -> list[Any]:
        if graph.seeded:
            return evaluate(graph, args[:-1], args[-1], tick)
        return evaluate(graph, args, None, tick)

    return program


def lower(graph: ProgramGraph, tick: Callable[[int, int], None] | None = None) -> bytes:
    """The program as a StableHLO portable artifact (``jax.export``'s serialization);
    ``tick(done, total)``: how many of the graph's operators are lowered so far.

    Raises:
      UnsupportedOperator: an operator has no lowering.
      LoweringError: a lowering disagreed with torch on a result's shape.
    """
    fold_causal_masks(graph.gm)  # a constant causal attn_mask as is_causal=True
    sum_before_flattening(graph.gm)  # a Linear's bias gradient over (B, T, C), not (B*T, C)
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    avals = []
    for i in graph.inputs:
        meta = _meta_of(placeholders[i])
        shape = tuple(int(d) for d in meta.shape)
        avals.append(jax.ShapeDtypeStruct(shape, jax_dtype(meta.dtype)))  # type: ignore[no-untyped-call]
    if graph.seeded:
        avals.append(jax.ShapeDtypeStruct((), jnp.int64))  # type: ignore[no-untyped-call]
    with jax.enable_x64(True):
        exported = jax.export.export(
            jax.jit(program_function(graph, tick), keep_unused=True), platforms=("cpu",)
        )(*avals)
    data: bytes = bytes(exported.mlir_module_serialized)
    return data
