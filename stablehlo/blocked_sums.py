"""Long floating-point sums in blocks: accurate whichever CPU kernel runs them.

A ``stablehlo.reduce`` that adds many values says what to sum, not in what order, and
XLA's CPU kernels add them one after the other into a few accumulators: the rounding
error grows with the count, O(n eps). PyTorch's CPU ``sum`` adds in a cascade (blocks,
then the blocks' sums), O((n/b + b) eps) and less. A BatchNorm's statistics and its
backward's sums run over N*H*W values per channel (131,072 in a batch of 32 64x64
images), and how near a training run stays to float64 then depends on which code does
those sums: XLA's own loops, or YNNPACK's (jax >= 0.8 may hand reductions to it, per host
and per jax version). ``block_long_sums`` makes the order part of the program, so every
backend computes the same well-conditioned sum.

Every ``reduce`` of one f32, bf16 or f16 operand, from a zero, whose body is one
``add``, over more than ``LONG`` values per result, becomes sums of at most ``BLOCK``
values each: the reduced dimensions are taken innermost first into a block (a dimension
that does not fit is split, ``reshape [s] -> [s/q, q]``, free in row-major order, or
padded with zeros to a multiple when it has no fitting divisor), the block is summed, and
the sum over the remaining reduced dimensions is blocked the same way until every level
holds at most ``BLOCK`` values. An ``optimization_barrier`` stands between levels:
without it XLA's simplifier merges a reduce of a reduce back into one. The values summed
are the same, each exactly once; only the order changes. (A sum of nothing but -0.0
padded with +0.0 gives +0.0.) Sums that are not plain adds (max, variadic reductions),
integer and float64 sums, and short sums are left alone. A blocked sum's levels add at
most ``BLOCK`` values each, so a second pass finds nothing long and changes nothing.

Sums over one row's contiguous values are accurate as written; the loss is in sums over
several non-contiguous dimensions (BatchNorm's), and blocks of 64 bring those as near to
float64 as YNNPACK's reduction and numpy's pairwise sum (docs/numerics.md, "Long sums in
blocks", has what they change in training).

The runtime applies it on the CPU only (``runtime/compile/rewrites.py``): a TPU's and a
GPU's XLA already sum in trees (tiles and per-thread partial sums reduced pairwise).

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

import math
from typing import Any

from jaxlib.mlir import ir

from .artifact import Module
from .build import i64s, verify
from .build import op as build_op
from .graph import element_type, ints, producer, shape_of, splat_constant

__all__ = ["BLOCK", "LONG", "count_long_sums", "block_long_sums"]

LONG = 4096
"""Sums over more values than this (per result) are blocked."""

BLOCK = 64
"""The most values one level of a blocked sum adds."""

TYPES = ("f32", "bf16", "f16")
"""The element types whose long sums are blocked (float64's error is far below float32's
results; integer sums are exact)."""


def _is_sum(reduce: Any) -> bool:
    """``reduce`` adds one floating-point operand of ``TYPES`` from a zero."""
    if len(reduce.operands) != 2 or element_type(reduce.operands[0]) not in TYPES:
        return False
    init = producer(reduce.operands[1])
    if init is None or init.name != "stablehlo.constant" or splat_constant(init) != 0:
        return False
    block = reduce.regions[0].blocks[0]
    ops = list(block.operations)
    if len(ops) != 2 or ops[0].name != "stablehlo.add" or ops[1].name != "stablehlo.return":
        return False
    args = list(block.arguments)
    return list(ops[0].operands) in (args, args[::-1]) and list(ops[1].operands) == [ops[0].result]


def _count(reduce: Any) -> int:
    shape = shape_of(reduce.operands[0])
    return math.prod(shape[d] for d in ints(reduce, "dimensions"))


def _sites(module: Module) -> list[Any]:
    return [
        op
        for op in module._operations()
        if op.name == "stablehlo.reduce" and _is_sum(op) and _count(op) > LONG
    ]


def count_long_sums(module: Module) -> int:
    """How many sums ``block_long_sums`` would block (``module`` unchanged)."""
    with module._ctx:
        return len(_sites(module))


def _largest_divisor(s: int, limit: int) -> int:
    """The largest divisor of ``s`` that is at most ``limit`` (1 when none above it)."""
    return max((q for q in range(1, min(s, limit) + 1) if s % q == 0), default=1)


def _plan(shape: list[int], dims: list[int]) -> tuple[int, int, int, list[int]]:
    """How to take the first block of a sum of ``shape`` over ``dims``.

    Returns (split, q, padded, taken): the dimension split (-1 for none) into
    ``[padded // q, q]`` (``padded`` >= its size, zeros added when larger), and the
    reduced dimensions (of ``shape``) summed whole into the block with the ``q`` part.
    """
    p, taken = 1, []
    for d in sorted(dims, reverse=True):
        s = shape[d]
        if p * s <= BLOCK:
            p *= s
            taken.append(d)
            continue
        q = _largest_divisor(s, BLOCK // p)
        if 4 * p * q >= BLOCK:
            return d, q, s, taken
        if 4 * p >= BLOCK:  # the block is large enough without this dimension
            return -1, 1, s, taken
        q = BLOCK // p  # no fitting divisor (a prime size): pad to a multiple of q
        return d, q, -(-s // q) * q, taken
    return -1, 1, 0, taken


def _reduce(x: Any, init: Any, dims: list[int], out_shape: list[int], scalar: Any) -> Any:
    """A new sum of ``x`` over ``dims`` (at the current insertion point)."""
    elem = ir.RankedTensorType(x.type).element_type
    red = ir.Operation.create(
        "stablehlo.reduce",
        results=[ir.RankedTensorType.get(out_shape, elem)],
        operands=[x, init],
        attributes={"dimensions": i64s(dims)},
        regions=1,
    )
    body = red.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(body):
        total = build_op("stablehlo.add", scalar, [body.arguments[0], body.arguments[1]])
        ir.Operation.create("stablehlo.return", results=[], operands=[total])
    return red.result


def _blocked(x: Any, init: Any, dims: list[int]) -> Any:
    """The sum of ``x`` over ``dims``, in levels of at most ``BLOCK`` values."""
    shape = shape_of(x)
    t = ir.RankedTensorType(x.type)
    scalar = ir.RankedTensorType.get([], t.element_type)
    if math.prod(shape[d] for d in dims) <= BLOCK:
        kept = [n for d, n in enumerate(shape) if d not in dims]
        return _reduce(x, init, sorted(dims), kept, scalar)
    split, q, padded, taken = _plan(shape, dims)
    # The dimensions after splitting: (original dimension, part) with part 0 the outer
    # piece of a split dimension, 1 its inner piece (or the whole dimension).
    labels: list[tuple[int, int]] = []
    sizes: list[int] = []
    for d, n in enumerate(shape):
        if d == split:
            labels += [(d, 0), (d, 1)]
            sizes += [padded // q, q]
        else:
            labels.append((d, 1))
            sizes.append(n)
    if split >= 0:
        if padded != shape[split]:
            high = [padded - shape[split] if d == split else 0 for d in range(len(shape))]
            wide = list(shape)
            wide[split] = padded
            x = build_op(
                "stablehlo.pad",
                ir.RankedTensorType.get(wide, t.element_type),
                [x, init],
                edge_padding_low=i64s([0] * len(shape)),
                edge_padding_high=i64s(high),
                interior_padding=i64s([0] * len(shape)),
            )
        x = build_op("stablehlo.reshape", ir.RankedTensorType.get(sizes, t.element_type), [x])
    inner = [i for i, (d, part) in enumerate(labels) if d in taken or (d == split and part == 1)]
    left = [i for i in range(len(labels)) if i not in inner]
    first = _reduce(x, init, inner, [sizes[i] for i in left], scalar)
    # Without a barrier XLA's simplifier merges the levels back into one reduce (seen:
    # the same error as the unblocked sum).
    first = build_op("stablehlo.optimization_barrier", first.type, [first])
    rest = [k for k, i in enumerate(left) if labels[i][0] in dims]
    return _blocked(first, init, rest)


def block_long_sums(module: Module) -> int:
    """Block, in place, every long sum of ``module`` (see the module docstring).
    Returns the number of sums blocked (0 leaves the module as it was).

    Raises:
      ValueError: the module does not verify afterwards (it may be partly rewritten:
        the runtime rewrites a copy).
    """
    with module._ctx:
        sites = _sites(module)
        for red in sites:
            with ir.InsertionPoint(red), red.location:
                total = _blocked(red.operands[0], red.operands[1], ints(red, "dimensions"))
            red.results[0].replace_all_uses_with(total)
            red.erase()
        if sites:
            verify(module._module, "blocking long sums")
    return len(sites)
