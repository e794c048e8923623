"""Computing an attention mask when the program is compiled, over its distinct values only.

A mask the front-ends trace at a model's real size is larger than the load can compute
element by element: Hugging Face's masks (transformers' ``masking_utils``) are
(batch, 1, T, T), 8M elements at batch 8 and T = 1024, built from a (T, T) causal triangle
and-ed with a packed-sequence mask computed from the position ids (a cumulative sum,
``reduce_window``, read back with a ``gather``). Here each value is held as ``Values``:
its elements along the dims it varies over only, broadcast over the rest, and after every
operation a dim along which the elements are all equal is dropped (``_squeezed``). The
batch's packed-sequence mask of one sequence per row is one number, and the whole mask
one (T, T) triangle.

Each element is held as its element type holds it (``graph.converted`` and
``holds_integers``: a convert to bf16 rounds as bf16 does, positions past 256 in bf16 or
127 in int8 are not computed); what it cannot compute exactly it does not compute,
and says why (``MaskValues.why``): an argument of the step that is not known when the
program is compiled, a value larger than ``MAX_EVALUATED`` elements even over its distinct
values, or an operation not modelled here.

Imports: jaxlib's MLIR bindings (through ``graph``).
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir

from .graph import (
    FLOAT_BITS,
    MAX_EVALUATED,
    StateValues,
    comparison_direction,
    converted,
    dense_integers,
    element_type,
    holds_integers,
    int_range,
    ints,
    main_argument,
    producer,
    shape_of,
    splat_constant,
)

__all__ = ["MaskValues", "Values", "compute_mask", "is_causal"]

MAX_DEPTH = 64
"""The longest chain of operations followed back from a mask (Hugging Face's are ~25)."""


@dataclass(frozen=True)
class Values:
    """A value's elements: ``data`` in row-major order over the dims in ``keep`` (sorted,
    each of size > 1), the same along every other dim of ``shape``."""

    shape: tuple[int, ...]
    keep: tuple[int, ...]
    data: list[Any]

    def at(self, index: Sequence[int]) -> Any:
        """The element at ``index`` (a full index into ``shape``)."""
        offset = 0
        for d in self.keep:
            offset = offset * self.shape[d] + index[d]
        return self.data[offset]


class _Unknown(Exception):
    """Raised inside the evaluation: why the value is not computed."""


def _sizes(shape: Sequence[int], keep: Sequence[int]) -> list[int]:
    return [shape[d] for d in keep]


def _expanded(v: Values, keep: Sequence[int]) -> list[Any]:
    """``v``'s elements over ``keep`` (sorted, a superset of ``v.keep``), row-major."""
    data, have = v.data, list(v.keep)
    for d in keep:
        if d in have:
            continue
        n = v.shape[d]
        # the new dim's place among the kept ones: the elements after it form blocks
        inner = math.prod(v.shape[k] for k in have if k > d)
        if inner == 1:
            out: list[Any] = [None] * (len(data) * n)
            for k in range(n):
                out[k::n] = data
        else:
            out = []
            for o in range(0, len(data), inner):
                out.extend(data[o : o + inner] * n)
        data = out
        have = sorted([*have, d])
    return data


def _squeezed(shape: Sequence[int], keep: Sequence[int], data: list[Any]) -> Values:
    """``Values`` without the kept dims along which every element is the same."""
    keep = [d for d in keep if shape[d] > 1]
    for d in list(keep):
        sizes = _sizes(shape, keep)
        p = keep.index(d)
        n, inner = sizes[p], math.prod(sizes[p + 1 :])
        block = n * inner
        firsts = []
        for o in range(0, len(data), block):
            first = data[o : o + inner]
            if any(data[o + k * inner : o + (k + 1) * inner] != first for k in range(1, n)):
                break
            firsts.append(first)
        else:
            data = list(itertools.chain.from_iterable(firsts))
            keep.remove(d)
    return Values(tuple(shape), tuple(keep), data)


def _size_check(shape: Sequence[int], keep: Sequence[int]) -> None:
    n = math.prod(_sizes(shape, keep))
    if n > MAX_EVALUATED:
        raise _Unknown(
            f"larger than the load computes: a {list(shape)} value that varies over "
            f"{n} elements (the limit is {MAX_EVALUATED})"
        )


def _elementwise(shape: Sequence[int], args: list[Values], fn: Callable[..., Any]) -> Values:
    keep = sorted(set().union(*(a.keep for a in args)))
    _size_check(shape, keep)
    return _squeezed(shape, keep, list(map(fn, *(_expanded(a, keep) for a in args))))


def _convert(a: Values, elem: str) -> Values:
    # over the distinct values: a mask holds few (0.0 and -0.0 are one: the masks'
    # tests, compares and selects do not tell them apart)
    table = {x: converted(x, elem) for x in set(a.data)}
    if any(y is None for y in table.values()):
        raise _Unknown(f"a value its element type {elem} does not hold exactly")
    return _squeezed(a.shape, a.keep, list(map(table.__getitem__, a.data)))


_FLAT_DN = re.compile(r"(\w+) = (\[[^\]]*\]|\d+)")


def _gather_numbers(op: Any) -> dict[str, Any]:
    text = str(op.attributes["dimension_numbers"])
    out: dict[str, Any] = {}
    for key, val in _FLAT_DN.findall(text):
        out[key] = (
            [int(x) for x in val.strip("[]").split(",") if x.strip()] if "[" in val else int(val)
        )
    return out


class _Evaluator:
    def __init__(
        self,
        scalars: Mapping[int, float],
        state: StateValues,
        names: Mapping[int, str],
    ) -> None:
        self.scalars, self.state, self.names = scalars, state, names
        self.read: set[int] = set()
        self.memo: dict[Any, Values] = {}

    def value(self, v: Any, depth: int) -> Values:
        if depth > MAX_DEPTH:
            raise _Unknown(f"built by more than {MAX_DEPTH} operations in a chain")
        if v in self.memo:
            return self.memo[v]
        out = self._compute(v, depth)
        self.memo[v] = out
        return out

    def _argument(self, v: Any, shape: tuple[int, ...]) -> Values:
        num = main_argument(v)
        if num is None:
            raise _Unknown("read from an argument of a function other than @main")
        if num in self.state:
            self.read.add(num)
            name, values = self.state[num]
            known = values()
            if known is None or len(known) != math.prod(shape):
                raise _Unknown(f"read from the state {name!r}, whose value the load does not have")
            return _squeezed(shape, range(len(shape)), list(known))
        if num in self.scalars and shape == ():
            # held as the argument's type holds it (a caller may give integers as floats)
            x = converted(self.scalars[num], element_type(v))
            if x is None or x != self.scalars[num]:
                raise _Unknown(f"@main's argument {num} is not a {element_type(v)} value")
            return Values(shape, (), [x])
        what = self.names.get(num, f"@main's argument {num}")
        raise _Unknown(f"read from {what}, not known when the program is compiled")

    def _compute(self, v: Any, depth: int) -> Values:
        shape = tuple(shape_of(v))
        op = producer(v)
        if op is None:
            return self._argument(v, shape)
        name = op.name
        if name == "stablehlo.constant":
            s = splat_constant(op)
            if s is not None:
                return Values(shape, (), [s])
            dense = dense_integers(op)
            if dense is None:
                raise _Unknown(f"a constant of {element_type(op.result)} not read here")
            return _squeezed(shape, range(len(shape)), dense)
        if name == "stablehlo.iota":
            dim = int(ir.IntegerAttr(op.attributes["iota_dimension"]).value)
            elem = element_type(op.result)
            if not holds_integers(elem, shape[dim]):
                raise _Unknown(f"positions its element type {elem} does not hold exactly")
            kind: Callable[[int], Any] = float if elem in FLOAT_BITS else int
            return _squeezed(shape, [dim], [kind(i) for i in range(shape[dim])])
        if name not in _OPS:
            raise _Unknown(f"computed by {name}, which the load does not compute")
        args = [self.value(o, depth + 1) for o in op.operands]
        return _OPS[name](op, shape, args)


def _broadcast(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
    (a,) = args
    dims = ints(op, "broadcast_dimensions")
    keep = [dims[k] for k in a.keep]
    if keep != sorted(keep):
        raise _Unknown("a broadcast that transposes, not computed here")
    return Values(shape, tuple(keep), a.data)


def _reshape(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
    (a,) = args
    src = [d for d, n in enumerate(a.shape) if n > 1]
    dst = [d for d, n in enumerate(shape) if n > 1]
    if [a.shape[d] for d in src] == [shape[d] for d in dst]:  # unit dims only
        where = dict(zip(src, dst))
        return Values(shape, tuple(where[d] for d in a.keep), a.data)
    _size_check(a.shape, src)
    return _squeezed(shape, dst, _expanded(a, src))


def _slice(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
    (a,) = args
    starts, steps = ints(op, "start_indices"), ints(op, "strides")
    ranges = [range(starts[d], starts[d] + steps[d] * shape[d], steps[d]) for d in a.keep]
    sizes = _sizes(a.shape, a.keep)
    strides = [math.prod(sizes[k + 1 :]) for k in range(len(sizes))]
    data = [a.data[sum(i * s for i, s in zip(ix, strides))] for ix in itertools.product(*ranges)]
    return _squeezed(shape, a.keep, data)


def _concatenate(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
    d = int(ir.IntegerAttr(op.attributes["dimension"]).value)
    keep = sorted(set().union(*(a.keep for a in args)) | {d})
    _size_check(shape, keep)
    parts = [(_expanded(a, keep), a.shape[d]) for a in args]  # size 1 along d: once
    inner = math.prod(shape[k] for k in keep if k > d)
    outer = math.prod(shape[k] for k in keep if k < d)
    data: list[Any] = []
    for o in range(outer):
        for part, n in parts:
            data.extend(part[o * n * inner : (o + 1) * n * inner])
    return _squeezed(shape, keep, data)


def _reduce_window(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
    """A running sum along one dim (``torch.cumsum``'s lowering): integers only."""
    x, init = args
    body = op.regions[0].blocks[0]
    ops = list(body.operations)
    elem = element_type(op.results[0])
    bounds = int_range(elem)
    window = ints(op, "window_dimensions")
    long = [d for d, w in enumerate(window) if w > 1]
    pad = ir.DenseIntElementsAttr(op.attributes["padding"]) if "padding" in op.attributes else None
    pads = [int(pad[i]) for i in range(len(pad))] if pad is not None else [0] * (2 * len(window))
    plain = all(
        k not in op.attributes or all(int(s) == 1 for s in ir.DenseI64ArrayAttr(op.attributes[k]))
        for k in ("window_strides", "base_dilations", "window_dilations")
    )
    if (
        len(ops) != 2
        or ops[0].name != "stablehlo.add"
        or list(ops[0].operands) != list(body.arguments)
        or list(ops[1].operands) != [ops[0].result]  # the body returns the sum
        or init.data != [0]
        or bounds is None
        or len(long) != 1
        or not plain
        or pads
        != [
            window[d] - 1 if (k == 0 and d == long[0]) else 0
            for d in range(len(window))
            for k in (0, 1)
        ]
        or len(op.results) != 1
        or init.keep
    ):
        raise _Unknown("a reduce_window other than an integer running sum, not computed here")
    d, w = long[0], window[long[0]]
    keep = sorted(set(x.keep) | {d})
    _size_check(shape, keep)
    data = _expanded(x, keep)
    n, inner = shape[d], math.prod(shape[k] for k in keep if k > d)
    out: list[Any] = [None] * len(data)
    for o in range(0, len(data), n * inner):
        for i in range(inner):
            run = [data[o + k * inner + i] for k in range(n)]
            prefix = [0, *itertools.accumulate(run)]
            for k in range(n):
                out[o + k * inner + i] = init.data[0] + prefix[k + 1] - prefix[max(0, k + 1 - w)]
    if any(not bounds[0] <= y <= bounds[1] for y in out):
        raise _Unknown(f"a running sum that wraps in {elem}")
    return _squeezed(shape, keep, out)


def _gather(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
    """A gather of single elements (``t[i, j]`` with index tensors): every operand dim
    collapsed, slices of one element, the index vector last."""
    src, idx = args
    dn = _gather_numbers(op)
    rank = len(src.shape)
    if (
        set(dn) != {"collapsed_slice_dims", "start_index_map", "index_vector_dim"}
        or dn["collapsed_slice_dims"] != list(range(rank))
        or sorted(dn["start_index_map"]) != list(range(rank))
        or dn["index_vector_dim"] != len(idx.shape) - 1
        or idx.shape[-1] != rank
        or ints(op, "slice_sizes") != [1] * rank
    ):
        raise _Unknown("a gather other than of single elements, not computed here")
    last = len(idx.shape) - 1
    keep = [k for k in idx.keep if k != last]
    _size_check(shape, keep)
    full = _expanded(idx, [*keep, last] if idx.shape[last] > 1 else keep)
    data = []
    for o in range(0, len(full), rank):
        at = [0] * rank
        for k, dim in enumerate(dn["start_index_map"]):
            at[dim] = min(max(int(full[o + k]), 0), src.shape[dim] - 1)  # gather clamps
        data.append(src.at(at))
    return _squeezed(shape, keep, data)


def _logic(fn: Callable[[Any, Any], Any]) -> Callable[[Any, tuple[int, ...], list[Values]], Values]:
    def apply(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
        if element_type(op.result) != "i1" and int_range(element_type(op.result)) is None:
            raise _Unknown(f"{op.name} on {element_type(op.result)}, not computed here")
        return _elementwise(shape, args, fn)

    return apply


def _not(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
    if element_type(op.result) != "i1":
        raise _Unknown("a bitwise not on integers, not computed here")
    return _elementwise(shape, args, operator.not_)


def _sum(sign: int) -> Callable[[Any, tuple[int, ...], list[Values]], Values]:
    def apply(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
        elem = element_type(op.result)
        bounds = int_range(elem)
        if bounds is None:  # integers only (positions: ``j - i``)
            raise _Unknown(f"a sum of {elem}, not computed here")
        out = _elementwise(shape, args, lambda x, y: x + sign * y)
        if any(not bounds[0] <= y <= bounds[1] for y in out.data):
            raise _Unknown(f"a sum that wraps in {elem}")
        return out

    return apply


_DIRECTIONS = {
    "EQ": operator.eq,
    "NE": operator.ne,
    "GE": operator.ge,
    "GT": operator.gt,
    "LE": operator.le,
    "LT": operator.lt,
}


def _compare(op: Any, shape: tuple[int, ...], args: list[Values]) -> Values:
    fn = _DIRECTIONS.get(comparison_direction(op))
    if fn is None:
        raise _Unknown("a comparison not computed here")
    return _elementwise(shape, args, fn)


_OPS: dict[str, Callable[[Any, tuple[int, ...], list[Values]], Values]] = {
    "stablehlo.broadcast_in_dim": _broadcast,
    "stablehlo.reshape": _reshape,
    "stablehlo.slice": _slice,
    "stablehlo.concatenate": _concatenate,
    "stablehlo.reduce_window": _reduce_window,
    "stablehlo.gather": _gather,
    "stablehlo.convert": lambda op, shape, args: _convert(args[0], element_type(op.result)),
    "stablehlo.compare": _compare,
    "stablehlo.and": _logic(operator.and_),  # bool & bool is a bool
    "stablehlo.or": _logic(operator.or_),
    "stablehlo.not": _not,
    "stablehlo.add": _sum(1),
    "stablehlo.subtract": _sum(-1),
    "stablehlo.select": lambda op, shape, args: _elementwise(
        shape, args, lambda c, y, z: y if c else z
    ),
}


@dataclass(frozen=True)
class MaskValues:
    """What computing a mask when the program is compiled gave: its ``values`` (None
    when not computed, and then ``why``), and the state arguments it read."""

    values: Values | None
    reads: tuple[int, ...]
    why: str


def compute_mask(
    value: Any,
    scalars: Mapping[int, float],
    state: StateValues,
    names: Mapping[int, str] | None = None,
) -> MaskValues:
    """``value``'s elements, computed on the host from constants, iotas, ``scalars``
    (@main's scalar constant arguments) and ``state`` (state the step never writes, as
    loaded), or why not. ``names`` says what the other @main arguments are (an input of
    the step, state the step writes), for the reason."""
    ev = _Evaluator(scalars, state, names or {})
    try:
        values: Values | None = ev.value(value, 0)
        why = ""
    except _Unknown as e:
        values, why = None, str(e)
    return MaskValues(values, tuple(sorted(ev.read)), why)


def is_causal(values: Values, kept: Callable[[Any], bool], masked: Callable[[Any], bool]) -> bool:
    """Whether every (Tq, Tk) slice (the last two dims) of ``values`` is the top-left
    lower triangle: ``kept`` on and below the diagonal, ``masked`` above it."""
    *_, tq, tk = values.shape
    rank = len(values.shape)
    keep = list(values.keep)
    if tq > 1 and tk > 1 and keep[-2:] != [rank - 2, rank - 1]:
        return False  # a triangle varies along both: row 0 and column 1 change
    last = [d for d in (rank - 2, rank - 1) if values.shape[d] > 1]
    data = _expanded(values, sorted({*keep, *last}))
    # each distinct value as 1 (kept), 0 (masked) or 2 (neither), rows compared whole
    table = {v: 1 if kept(v) else 0 if masked(v) else 2 for v in set(data)}
    codes = list(map(table.__getitem__, data))
    ones, zeros = [1] * tk, [0] * tk
    for s in range(0, len(codes), tk):
        i = (s // tk) % tq
        cut = min(i + 1, tk)
        if codes[s : s + cut] != ones[:cut] or codes[s + cut : s + tk] != zeros[: tk - cut]:
            return False
    return True
