"""Sums over a one-hot axis as gathers: the cross-entropy loss without its full-vocabulary passes.

torch_xla writes ``cross_entropy``'s negative log-likelihood with a one-hot of the
targets, not a gather: ``onehot = select(target == iota, 1, 0)`` over (tokens, vocab),
multiplied into the log-probabilities, with the ignore mask, and summed. A 55M GPT's step
(benchmarks/device/gpt.py: 8,192 tokens, a 16,384 vocabulary) has three such sums, each
a pass over 134M elements: the loss (reading the bf16 logits, 268 MB), the count of
targets not ignored, and a per-token sum in the backward. On a TPU v5e they took 0.36,
0.21 and 0.26 ms of the step's 30.3 ms (``fusion.6``, ``fusion.1`` and ``fusion.12`` in
gpt-kv-layout-bundle-ops.json), where one value per token is all they read.

``rewrite_onehot_reductions`` finds every ``reduce`` (add, from zero) over a dimension
``j`` whose operand is zero wherever index ``j`` differs from a target ``t`` (built
from ``iota(j) == t`` through selects, compares, products, quotients, negations,
converts, sums and differences) and evaluates the operand at ``j = t`` instead: each
elementwise operation is redone on the per-token values, a broadcast along ``j``
becomes its source, ``iota(j)`` becomes ``t``, and any other tensor is gathered at
``t``. A target outside ``[0, size)`` (torch's ``ignore_index``) selects 0, as the
one-hot of it is all zeros. The sum over ``j`` of values that are zero but one is that
one, so the per-token results are exact (but for the sign of a zero: -0.0 at the target
now stays -0.0, where 0.0 + -0.0 gave 0.0); a sum over other dimensions too (the loss)
now adds the per-token values in another order (its last bit may differ).

What the rewrite assumes: that ``0 * x`` is 0, and ``0 / x`` too for a float ``x`` the
same across the classes (the loss's count). A NaN or infinity in another factor at a
position off the target, or a count of 0, no longer reaches the sum. In a cross-entropy
it cannot be lost: a non-finite logit makes its row's max or log-sum NaN, which every
class's log-probability (the target's too) carries. Where the arithmetic of a form could
differ from Python's, the form is left alone: targets narrower than 32 bits (an iota of
``i8`` wraps), unsigned or complex sums, a one-hot's two values other than -1, 0 and 1
(which negate and convert exactly in every type), constants read through converts,
integer division, and TOTALORDER comparisons. A chain too deep to follow (``MAX_DEPTH``)
is left alone too, or gathered as it is.

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir

from .artifact import Module
from .build import i64s, splat, verify
from .build import op as build_op
from .graph import COMPARISONS, comparison_direction, element_type, ints, producer, shape_of

__all__ = ["TUNING", "count_onehot_reductions", "rewrite_onehot_reductions"]

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
the class axis stays last (default False: on the GPT, 29.78 ms/step with it, 29.72
without); ``per_token`` (default True) also rewrites sums over the class axis alone
(the backward's), not only those over the tokens too (29.97 ms/step without them;
gpt-onehot-variants.json)."""

Key = tuple[Any, tuple[int, ...]]
"""A target: the value broadcast along ``j`` and its ``broadcast_dimensions``."""


MAX_DEPTH = 64
"""How far back from a sum the one-hot is looked for, and how deep the values at the
target are rebuilt (deeper: gathered as they are)."""

FLOATS = ("f16", "bf16", "f32", "f64")
SIGNED = ("i8", "i16", "i32", "i64")
TARGETS = ("i32", "i64", "ui32", "ui64")
"""Target types taken: wide enough for any class count below 2**31 (a narrower type's
iota wraps)."""
SMALL = (-1.0, 0.0, 1.0)
"""The constants a one-hot's two values may be: exact in every type, through negation
and conversion (others could round or wrap where Python's numbers do not)."""


def _const(v: Any) -> float | int | bool | None:
    """The number a splat constant of ``v``'s own type repeats (directly, or a scalar
    one broadcast), or None. No look-through converts: the value compared is the one
    the program holds."""
    op = producer(v)
    if op is not None and op.name == "stablehlo.broadcast_in_dim" and not shape_of(op.operands[0]):
        if element_type(op.operands[0]) != element_type(v):
            return None
        op = producer(op.operands[0])
    if op is None or op.name != "stablehlo.constant":
        return None
    attr = ir.DenseElementsAttr(op.attributes["value"])
    elem = element_type(op.result)
    if not attr.is_splat or not (elem in FLOATS or elem in SIGNED or elem == "i1"):
        return None
    value = attr.get_splat_value()
    if elem == "i1":
        return bool(ir.BoolAttr(value).value)
    if elem in FLOATS:
        return float(ir.FloatAttr(value).value)
    return int(ir.IntegerAttr(value).value)


def _attr_text(op: Any, name: str) -> str:
    return str(op.attributes[name]) if name in op.attributes else ""


def _is_zero_add(reduce: Any) -> bool:
    """``reduce`` sums one float or signed integer operand from a zero."""
    if len(reduce.operands) != 2:
        return False
    elem = element_type(reduce.operands[0])
    if not (elem in FLOATS or elem in SIGNED):  # not complex, not unsigned
        return False
    if _const(reduce.operands[1]) != 0:
        return False
    ops = list(reduce.regions[0].blocks[0].operations)
    if len(ops) != 2 or ops[0].name != "stablehlo.add":
        return False
    args = list(reduce.regions[0].blocks[0].arguments)
    return list(ops[0].operands) == args and list(ops[1].operands) == [ops[0].result]


class _Pattern:
    """Which values of one frame (shape, dimension ``j``) are one-hot along ``j``.

    ``kind(v)`` is ``("hot", key)`` (a predicate true exactly at ``j == t``),
    ``("cold", key)`` (its negation), ``("ind", key, on, off)`` (``on`` at ``j == t``,
    ``off`` elsewhere, both constants), ``("zero", key)`` (zero wherever ``j != t``),
    or None."""

    def __init__(self, shape: list[int], j: int) -> None:
        self.shape, self.j = shape, j
        self.memo: dict[Any, Any] = {}
        self.depth = 0

    def target(self, v: Any) -> Key | None:
        """``v`` as a broadcast, along ``j``, of an integer value: its key."""
        op = producer(v)
        if op is None or op.name != "stablehlo.broadcast_in_dim" or shape_of(v) != self.shape:
            return None
        src = op.operands[0]
        if element_type(src) not in TARGETS or self.shape[self.j] >= 2**31:
            return None
        dims = tuple(ints(op, "broadcast_dimensions"))
        if self.j in dims and shape_of(src)[dims.index(self.j)] != 1:
            return None
        return (src, dims)

    def flat(self, v: Any) -> bool:
        """``v`` is the same along ``j``: a constant, or a broadcast that does not vary there."""
        if _const(v) is not None:
            return True
        op = producer(v)
        if op is None or op.name != "stablehlo.broadcast_in_dim":
            return False
        dims = ints(op, "broadcast_dimensions")
        return self.j not in dims or shape_of(op.operands[0])[dims.index(self.j)] == 1

    def is_iota(self, v: Any) -> bool:
        return shape_of(v) == self.shape and _iota_axis(v) == self.j

    def zero(self, v: Any) -> Key | None:
        """The key if ``v`` is zero wherever ``j != t``."""
        k = self.kind(v)
        if k is None:
            return None
        if k[0] == "zero" or (k[0] == "ind" and k[3] == 0):
            return k[1]  # type: ignore[no-any-return]
        return None

    def kind(self, v: Any) -> Any:
        if v in self.memo:  # ir.Value hashes by identity of the SSA value
            return self.memo[v]
        if self.depth >= MAX_DEPTH:
            return None  # not remembered: nearer the sum it may be reached again
        self.depth += 1
        try:
            found = self._kind(v)
        finally:
            self.depth -= 1
        self.memo[v] = found
        return found

    def _kind(self, v: Any) -> Any:
        op = producer(v)
        if op is None or shape_of(v) != self.shape:
            return None
        name, xs = op.name, list(op.operands)
        if name == "stablehlo.compare" and comparison_direction(op) in COMPARISONS:
            if "TOTALORDER" in _attr_text(op, "compare_type"):
                return None  # -0.0 and 0.0 differ there; Python's == does not say so
            return self._compare(comparison_direction(op), xs[0], xs[1])
        if name == "stablehlo.not":
            k = self.kind(xs[0])
            flip = {"hot": "cold", "cold": "hot"}
            return (flip[k[0]], k[1]) if k is not None and k[0] in flip else None
        if name == "stablehlo.select":
            return self._select(*xs)
        if name in ("stablehlo.convert", "stablehlo.negate"):
            k = self.kind(xs[0])
            elem = element_type(v)
            if k is None:
                return None
            if name == "stablehlo.convert" and k[0] in ("hot", "cold"):
                return ("ind", k[1], 1.0, 0.0) if k[0] == "hot" else ("ind", k[1], 0.0, 1.0)
            if k[0] == "ind":
                if name == "stablehlo.negate":
                    ok = elem in FLOATS or elem in SIGNED
                    return ("ind", k[1], -k[2], -k[3]) if ok else None
                if elem in FLOATS or elem in SIGNED or elem == "i1":
                    return ("ind", k[1], k[2], k[3])  # -1, 0 and 1 are exact in each
                return None  # unsigned: -1 would wrap
            return k if k[0] == "zero" else None
        if name == "stablehlo.multiply":
            key = self.zero(xs[0]) or self.zero(xs[1])
            return ("zero", key) if key is not None else None
        if name == "stablehlo.divide" and element_type(v) in FLOATS and self.flat(xs[1]):
            key = self.zero(xs[0])  # 0 / x = 0, x the same for every class (a count)
            return ("zero", key) if key is not None else None
        if name in ("stablehlo.add", "stablehlo.subtract"):
            a, b = self.zero(xs[0]), self.zero(xs[1])
            return ("zero", a) if a is not None and _same(a, b) else None
        return None

    def _compare(self, direction: str, a: Any, b: Any) -> Any:
        for x, y in ((a, b), (b, a)):
            if self.is_iota(x):
                key = self.target(y)
                if key is not None and direction in ("EQ", "NE"):
                    return ("hot" if direction == "EQ" else "cold", key)
        for x, y, swap in ((a, b, False), (b, a, True)):
            k, c = self.kind(x), _const(y)
            if k is None or k[0] != "ind" or c is None:
                continue
            fn = COMPARISONS[direction]
            on, off = (fn(c, k[2]), fn(c, k[3])) if swap else (fn(k[2], c), fn(k[3], c))
            if on and not off:
                return ("hot", k[1])
            if off and not on:
                return ("cold", k[1])
        return None

    def _select(self, pred: Any, a: Any, b: Any) -> Any:
        kp = self.kind(pred)
        if kp is not None and kp[0] in ("hot", "cold"):
            sa, sb = _const(a), _const(b)
            if sa in SMALL and sb in SMALL:
                on, off = (sa, sb) if kp[0] == "hot" else (sb, sa)
                return ("ind", kp[1], on, off)
            off_hot = b if kp[0] == "hot" else a  # the value taken wherever j != t
            if _const(off_hot) == 0 or _same(self.zero(off_hot), kp[1]):
                return ("zero", kp[1])
        ka, kb = self.zero(a), self.zero(b)
        if ka is not None and _same(ka, kb):
            return ("zero", ka)
        if ka is not None and _const(b) == 0:
            return ("zero", ka)
        if kb is not None and _const(a) == 0:
            return ("zero", kb)
        return None


def _iota_axis(v: Any, depth: int = 0) -> int | None:
    """The axis ``v`` counts along (an iota, broadcast whole into a larger shape or given
    unit dimensions), or None."""
    op = producer(v)
    if op is None or depth > 8:
        return None
    if op.name == "stablehlo.iota":
        return int(ir.IntegerAttr(op.attributes["iota_dimension"]).value)
    if op.name == "stablehlo.broadcast_in_dim":
        inner = _iota_axis(op.operands[0], depth + 1)
        if inner is None:
            return None
        axis = ints(op, "broadcast_dimensions")[inner]
        return axis if shape_of(op.operands[0])[inner] == shape_of(v)[axis] else None
    if op.name == "stablehlo.reshape":  # one that only adds or drops unit dimensions
        inner = _iota_axis(op.operands[0], depth + 1)
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


def _same(a: Key | None, b: Key | None) -> bool:
    return a is not None and b is not None and a[0] == b[0] and a[1] == b[1]


def _drop(dims: tuple[int, ...], j: int) -> tuple[int, ...]:
    return tuple(d - (d > j) for d in dims)


class _Gather:
    """Build, before ``at``, the values of a frame's tensors at ``j = index`` (``index``:
    an integer tensor of the frame's shape without ``j``)."""

    def __init__(self, shape: list[int], j: int, index: Any, at: Any) -> None:
        self.shape, self.j, self.index, self.at = shape, j, index, at
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
        if name == "stablehlo.constant" and ir.DenseElementsAttr(op.attributes["value"]).is_splat:
            value = ir.DenseElementsAttr(op.attributes["value"]).get_splat_value()
            t = self._type(elem)
            return build_op(
                "stablehlo.constant", t, [], value=ir.DenseElementsAttr.get_splat(t, value)
            )
        if name == "stablehlo.iota":
            d = int(ir.IntegerAttr(op.attributes["iota_dimension"]).value)
            if d == self.j:
                return build_op("stablehlo.convert", self._type(elem), [self.index])
            dim = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d - (d > self.j))
            return build_op("stablehlo.iota", self._type(elem), [], iota_dimension=dim)
        if name == "stablehlo.broadcast_in_dim":
            if _iota_axis(v) == self.j:
                return build_op("stablehlo.convert", self._type(elem), [self.index])
            src = self.source(op.operands[0], tuple(ints(op, "broadcast_dimensions")))
            if src is not None:
                return src
        sink = TUNING.get("through_reshapes", False)
        if sink and name == "stablehlo.reshape" and self.j == len(self.shape) - 1:
            x = op.operands[0]
            inner = shape_of(x)
            if inner and inner[-1] == self.shape[-1]:
                lead = ir.RankedTensorType.get(inner[:-1], element_type_of(self.index))
                index = build_op("stablehlo.reshape", lead, [self.index])
                sub = _Gather(inner, len(inner) - 1, index, self.at)
                return build_op("stablehlo.reshape", self._type(elem), [sub.of(x)])
        if name in ELEMENTWISE and all(shape_of(x) == self.shape for x in op.operands):
            attrs = {
                op.attributes[i].name: op.attributes[i].attr for i in range(len(op.attributes))
            }
            xs = [self.of(x) for x in op.operands]
            return build_op(name, self._type(elem), xs, **attrs)
        return self.leaf(v)

    def source(self, x: Any, dims: tuple[int, ...]) -> Any:
        """A broadcast's source ``x`` (into the frame along ``dims``) in the output's
        frame, or None when ``x`` varies along ``j``."""
        xs = shape_of(x)
        if self.j in dims:
            p = dims.index(self.j)
            if xs[p] != 1:
                return None
            kept = xs[:p] + xs[p + 1 :]
            x = build_op(
                "stablehlo.reshape", ir.RankedTensorType.get(kept, element_type_of(x)), [x]
            )
            dims = dims[:p] + dims[p + 1 :]
        out = self._type(element_type_of(x))
        return build_op(
            "stablehlo.broadcast_in_dim", out, [x], broadcast_dimensions=i64s(_drop(dims, self.j))
        )

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


def _index(key: Key, shape: list[int], j: int) -> Any:
    """The target ``key`` names, as a tensor of the frame's shape without ``j``."""
    src, dims = key
    g = _Gather(shape, j, None, None)
    return g.source(src, dims)


def _rewrite(reduce: Any, j: int, key: Key, shape: list[int]) -> None:
    x = reduce.operands[0]
    with ir.InsertionPoint(reduce), reduce.location:
        index = _index(key, shape, j)
        value = _Gather(shape, j, index, reduce).of(x)
        it = element_type_of(index)
        inside = build_op(
            "stablehlo.and",
            ir.RankedTensorType.get(shape[:j] + shape[j + 1 :], ir.IntegerType.get_signless(1)),
            [
                _cmp(index, splat(shape[:j] + shape[j + 1 :], it, 0), "GE"),
                _cmp(index, splat(shape[:j] + shape[j + 1 :], it, shape[j]), "LT"),
            ],
        )
        zero = splat(shape[:j] + shape[j + 1 :], element_type_of(value), 0)
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


def _sites(module: Module) -> list[tuple[Any, int, Key, list[int]]]:
    """The sums to rewrite: (reduce, j, target, the operand's shape)."""
    found = []
    for op in [o for o in module._operations() if o.name == "stablehlo.reduce"]:
        if not _is_zero_add(op) or not any(True for _ in op.results[0].uses):
            continue  # not a sum from zero, or one already rewritten (left unused)
        shape = shape_of(op.operands[0])
        if len(ints(op, "dimensions")) == 1 and not TUNING.get("per_token", True):
            continue
        for j in ints(op, "dimensions"):
            key = _Pattern(shape, j).zero(op.operands[0])
            if key is not None:
                found.append((op, j, key, shape))
                break
    return found


def count_onehot_reductions(module: Module) -> int:
    """How many sums ``rewrite_onehot_reductions`` would rewrite (``module`` unchanged)."""
    with module._ctx:
        return len(_sites(module))


def rewrite_onehot_reductions(module: Module) -> int:
    """Rewrite, in place, every sum over a one-hot axis (see the module docstring) into
    the values at the target. Returns the number of sums rewritten.

    Raises:
      ValueError: the module does not verify afterwards (it may be partly rewritten:
        the runtime rewrites a copy).
    """
    with module._ctx:
        sites = _sites(module)
        for site in sites:
            _rewrite(*site)
        if sites:
            verify(module._module, "rewriting one-hot sums")
    return len(sites)
