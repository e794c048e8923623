"""The values of a one-hot sum's operand at its target: the rewrite ``onehot.py`` finds.

``rewrite_site`` rebuilds the operand of a sum over ``j`` at ``j = t``: each elementwise
operation is redone on the per-token values, a broadcast along ``j`` becomes its source,
``iota(j)`` becomes ``t``, and any other tensor is gathered at ``t``; a target outside
``[0, size)`` selects 0. ``onehot.py`` decides which sums may be rewritten so.

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir

from .build import i64s, splat
from .build import op as build_op
from .graph import ints, producer, shape_of

__all__ = ["ELEMENTWISE", "MAX_DEPTH", "TUNING", "Key", "iota_axis", "rewrite_site"]

Key = tuple[Any, tuple[int, ...]]
"""A target: the value broadcast along ``j`` and its ``broadcast_dimensions``."""

ELEMENTWISE = frozenset(
    f"stablehlo.{n}"
    for n in (
        *("abs", "add", "and", "compare", "convert", "cosine", "divide", "exponential"),
        *("exponential_minus_one", "floor", "log", "log_plus_one", "logistic", "maximum"),
        *("minimum", "multiply", "negate", "not", "or", "power", "remainder"),
        *("round_nearest_even", "rsqrt", "select", "sign", "sine", "sqrt", "subtract"),
        *("tanh", "xor"),
    )
)
"""Operations computed element by element (all operands of the result's shape): they
commute with evaluating at ``j = t``."""


TUNING: dict[str, bool] = {}
"""Choices for benchmarks (``benchmarks/device/gpt.py bench --variant
'NAME={"onehot": {...}}'``): ``through_reshapes`` gathers from a reshape's source when
the class axis stays last (default False: no faster on the GPT); ``per_token`` (default
True) also rewrites sums over the class axis alone (the backward's), not only those over
the tokens too (docs/tpu.md cites gpt-onehot-variants.json for both)."""


MAX_DEPTH = 64
"""How far back from a sum the one-hot is looked for, and how deep the values at the
target are rebuilt (deeper: gathered as they are)."""


def iota_axis(v: Any, depth: int = 0) -> int | None:
    """The axis ``v`` counts along (an iota, broadcast whole into a larger shape or given
    unit dimensions), or None."""
    op = producer(v)
    if op is None or depth > 8:
        return None
    if op.name == "stablehlo.iota":
        return int(ir.IntegerAttr(op.attributes["iota_dimension"]).value)
    if op.name == "stablehlo.broadcast_in_dim":
        inner = iota_axis(op.operands[0], depth + 1)
        if inner is None:
            return None
        axis = ints(op, "broadcast_dimensions")[inner]
        return axis if shape_of(op.operands[0])[inner] == shape_of(v)[axis] else None
    if op.name == "stablehlo.reshape":  # one that only adds or drops unit dimensions
        inner = iota_axis(op.operands[0], depth + 1)
        src, out = shape_of(op.operands[0]), shape_of(v)
        big_in = [d for d, n in enumerate(src) if n != 1]
        big_out = [d for d, n in enumerate(out) if n != 1]
        if (
            inner is None
            or inner not in big_in
            or [src[d] for d in big_in] != [out[d] for d in big_out]
        ):
            return None
        return big_out[big_in.index(inner)]
    return None


def _drop(dims: tuple[int, ...], j: int) -> tuple[int, ...]:
    return tuple(d - (d > j) for d in dims)


class _Gather:
    """Build, at the insertion point, the values of a frame's tensors at ``j = index`` (``index``:
    an integer tensor of the frame's shape without ``j``)."""

    def __init__(self, shape: list[int], j: int, index: Any) -> None:
        self.shape, self.j, self.index = shape, j, index
        self.out = shape[:j] + shape[j + 1 :]
        self.memo: dict[Any, Any] = {}
        self.depth = 0

    def _type(self, elem: Any) -> Any:
        return ir.RankedTensorType.get(self.out, elem)

    def of(self, v: Any) -> Any:
        if v not in self.memo:
            self.depth += 1
            try:
                # deep enough: gathered as it is (always right, only less direct)
                self.memo[v] = self._of(v) if self.depth < MAX_DEPTH else self.leaf(v)
            finally:
                self.depth -= 1
        return self.memo[v]

    def _of(self, v: Any) -> Any:
        op = producer(v)
        elem = ir.RankedTensorType(v.type).element_type
        if op is None:
            return self.leaf(v)
        name = op.name
        if iota_axis(v) == self.j:  # an iota along j (or one broadcast): the index
            return build_op("stablehlo.convert", self._type(elem), [self.index])
        if name == "stablehlo.constant" and ir.DenseElementsAttr(op.attributes["value"]).is_splat:
            value = ir.DenseElementsAttr(op.attributes["value"]).get_splat_value()
            t = self._type(elem)
            return build_op(
                "stablehlo.constant", t, [], value=ir.DenseElementsAttr.get_splat(t, value)
            )
        if name == "stablehlo.iota":
            d = int(ir.IntegerAttr(op.attributes["iota_dimension"]).value)
            dim = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d - (d > self.j))
            return build_op("stablehlo.iota", self._type(elem), [], iota_dimension=dim)
        if name == "stablehlo.broadcast_in_dim":
            src = _source(op.operands[0], tuple(ints(op, "broadcast_dimensions")), self.j, self.out)
            if src is not None:
                return src
        sink = TUNING.get("through_reshapes", False)
        if sink and name == "stablehlo.reshape" and self.j == len(self.shape) - 1:
            x = op.operands[0]
            inner = shape_of(x)
            if inner and inner[-1] == self.shape[-1]:
                lead = ir.RankedTensorType.get(inner[:-1], element_type_of(self.index))
                index = build_op("stablehlo.reshape", lead, [self.index])
                sub = _Gather(inner, len(inner) - 1, index)
                return build_op("stablehlo.reshape", self._type(elem), [sub.of(x)])
        if name in ELEMENTWISE and all(shape_of(x) == self.shape for x in op.operands):
            attrs = {
                op.attributes[i].name: op.attributes[i].attr for i in range(len(op.attributes))
            }
            xs = [self.of(x) for x in op.operands]
            return build_op(name, self._type(elem), xs, **attrs)
        return self.leaf(v)

    def leaf(self, v: Any) -> Any:
        """``v`` gathered at ``j = index``: one element per output position."""
        rank = len(self.shape)
        others = [d for d in range(rank) if d != self.j]
        idx_t = ir.RankedTensorType.get([*self.out, 1], element_type_of(self.index))
        idx = build_op("stablehlo.reshape", idx_t, [self.index])
        batch = ", ".join(map(str, others))
        numbers = ir.Attribute.parse(
            f"#stablehlo.gather<offset_dims = [], collapsed_slice_dims = [{self.j}], "
            f"operand_batching_dims = [{batch}], "
            f"start_indices_batching_dims = [{', '.join(map(str, range(rank - 1)))}], "
            f"start_index_map = [{self.j}], index_vector_dim = {rank - 1}>"
        )
        return build_op(
            "stablehlo.gather",
            self._type(ir.RankedTensorType(v.type).element_type),
            [v, idx],
            dimension_numbers=numbers,
            indices_are_sorted=ir.BoolAttr.get(False),
            slice_sizes=i64s([1] * rank),
        )


def element_type_of(v: Any) -> Any:
    return ir.RankedTensorType(v.type).element_type


def _source(x: Any, dims: tuple[int, ...], j: int, out: list[int]) -> Any:
    """``x``, broadcast into a frame along ``dims``, broadcast into the frame without
    ``j`` (shape ``out``) instead; None when ``x`` varies along ``j``."""
    xs = shape_of(x)
    if j in dims:
        p = dims.index(j)
        if xs[p] != 1:
            return None
        kept = xs[:p] + xs[p + 1 :]
        x = build_op("stablehlo.reshape", ir.RankedTensorType.get(kept, element_type_of(x)), [x])
        dims = dims[:p] + dims[p + 1 :]
    out_t = ir.RankedTensorType.get(out, element_type_of(x))
    return build_op(
        "stablehlo.broadcast_in_dim", out_t, [x], broadcast_dimensions=i64s(_drop(dims, j))
    )


def rewrite_site(reduce: Any, j: int, key: Key, shape: list[int]) -> None:
    """Replace the sum ``reduce`` over ``j`` (one-hot of target ``key``) by its operand's
    values at the target, summed over the other dimensions it summed."""
    x = reduce.operands[0]
    out = shape[:j] + shape[j + 1 :]
    with ir.InsertionPoint(reduce), reduce.location:
        index = _source(*key, j, out)
        value = _Gather(shape, j, index).of(x)
        it = element_type_of(index)
        inside = build_op(
            "stablehlo.and",
            ir.RankedTensorType.get(out, ir.IntegerType.get_signless(1)),
            [_cmp(index, splat(out, it, 0), "GE"), _cmp(index, splat(out, it, shape[j]), "LT")],
        )
        zero = splat(out, element_type_of(value), 0)
        picked = build_op("stablehlo.select", value.type, [inside, value, zero])
    dims = [d for d in ints(reduce, "dimensions") if d != j]
    if not dims:  # the sum is left, unused, for XLA to drop: no other site loses an op
        reduce.results[0].replace_all_uses_with(picked)
        return
    reduce.operands[0] = picked
    reduce.attributes["dimensions"] = i64s(_drop(tuple(dims), j))


def _cmp(a: Any, b: Any, direction: str) -> Any:
    t = ir.RankedTensorType.get(shape_of(a), ir.IntegerType.get_signless(1))
    attr = ir.Attribute.parse(f"#stablehlo<comparison_direction {direction}>")
    return build_op("stablehlo.compare", t, [a, b], comparison_direction=attr)
