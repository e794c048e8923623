"""Sums over a one-hot axis as gathers: the cross-entropy loss without its full-vocabulary passes.

torch_xla writes ``cross_entropy``'s negative log-likelihood with a one-hot of the
targets, not a gather: ``onehot = select(target == iota, 1, 0)`` over (tokens, vocab),
multiplied into the log-probabilities, with the ignore mask, and summed. A 55M GPT's step
(benchmarks/device/gpt.py: 8,192 tokens, a 16,384 vocabulary) has three such sums, each
a pass over 134M elements: the loss (reading the bf16 logits), the count of targets not
ignored, and a per-token sum in the backward, where one value per token is all they read
(docs/tpu.md has what they cost on a TPU).

``rewrite_onehot_reductions`` finds every ``reduce`` (add, from zero) over a dimension
``j`` whose operand is zero wherever index ``j`` differs from a target ``t`` (built
from ``iota(j) == t`` through selects, compares, products, quotients, negations,
converts, sums and differences) and evaluates the operand at ``j = t`` instead: each
elementwise operation is redone on the per-token values, a broadcast along ``j``
becomes its source, ``iota(j)`` becomes ``t``, and any other tensor is gathered at
``t`` (``onehot_gather.py``). A target outside ``[0, size)`` (torch's ``ignore_index``)
selects 0, as the
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

from .artifact import Module
from .build import verify
from .graph import (
    COMPARISONS,
    comparison_direction,
    element_type,
    ints,
    producer,
    shape_of,
    splat_constant,
)
from .onehot_gather import MAX_DEPTH, TUNING, Key, iota_axis, rewrite_site

__all__ = ["TUNING", "count_onehot_reductions", "rewrite_onehot_reductions"]


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
    elem = element_type(op.result)
    return splat_constant(op) if elem in FLOATS or elem in SIGNED or elem == "i1" else None


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
        return shape_of(v) == self.shape and iota_axis(v) == self.j

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


def _same(a: Key | None, b: Key | None) -> bool:
    return a is not None and b is not None and a[0] == b[0] and a[1] == b[1]


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
            rewrite_site(*site)
        if sites:
            verify(module._module, "rewriting one-hot sums")
    return len(sites)
