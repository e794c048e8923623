"""Each later product of a split parameter reads its own copy of it, behind a barrier tied
to that product's other operand: under a fully sharded layout the SPMD partitioner then
gathers the weight again next to each use (the runtime's ``regather-weights`` rewrite,
#41).

Under autocast a weight ``W`` is converted to bf16 once, and that one value feeds the
forward product ``x @ W^T`` and the backward's input-gradient product ``dy @ W`` (and, with
activation checkpointing, the recomputation's product too: XLA merges the recomputed
convert with the forward's, as the parameters do not pass the recomputation's barrier).
With ``W`` split over the data axis (``fsdp``) the partitioner gathers that value once,
and the backward pass is scheduled around what the forward gathered: compiled for a
v5e-256 (Llama 3 8B's shapes, one 2048-token sequence a chip) libtpu kept every layer's
whole float32 weight-gradient partial sums until all-reduces at the end of the step
(10.6 GiB of the 13.3 GiB live at the peak) and needed 16.31 GiB of a chip's 15.75
usable; with each later product gathering its own copy, each layer's gradients are
all-reduced in its own backward and the program needs 13.12 GiB (docs/parallel.md).
JAX and MaxText gather again in the backward because the parameters are inputs of the
rematerialized function.

Here, for each ``@main`` argument in ``args`` (the parameters the layout splits over
the data axis), the products (``stablehlo.dot_general``) that read it through a chain
of ``VIEWS`` are taken in program order; the first keeps the chain as it is, and each
later one gets its own copy of the chain, started from
``stablehlo.optimization_barrier(W, other)``, where ``other`` is the product's other
operand, which the product then reads from the barrier as well. The barrier cannot run
before ``other`` exists (the gradient that reaches the layer, in the backward pass), so
neither can the copy's convert nor the gather the partitioner puts after it; and the copy
is another value than the forward's, so XLA does not merge the two gathers. A barrier is
the identity and the copy computes what the chain computes, so the program's values do
not change (``tests/runtime/test_regather.py``; ``test_layouts.py`` compares the bits of
runs on 4 CPU devices); a later product only gathers its weight once more (ZeRO-3's
second gather).

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jaxlib.mlir import ir

from .artifact import Module
from .build import verify

__all__ = ["VIEWS", "count_regathers", "rewrite_regathers"]

VIEWS = frozenset(
    {
        "stablehlo.convert",
        "stablehlo.transpose",
        "stablehlo.reshape",
        "stablehlo.bitcast_convert",
    }
)
"""The operations a parameter may pass on its way to a product: each takes one operand
and changes neither which numbers it holds nor how many (a convert rounds, the same way
in every copy)."""

_BARRIER = "stablehlo.optimization_barrier"
_PRODUCT = "stablehlo.dot_general"


def _uses(value: Any) -> list[tuple[Any, int]]:
    """(operation, operand number) of each use of ``value``."""
    out = []
    for use in value.uses:
        owner = use.owner
        out.append((getattr(owner, "operation", owner), use.operand_number))
    return out


def _products(arg: Any) -> list[tuple[Any, int, list[Any]]]:
    """The products that read ``arg`` through ``VIEWS``: (product, operand number, the
    chain of view operations from ``arg`` to that operand, first to last)."""
    found: list[tuple[Any, int, list[Any]]] = []
    stack: list[tuple[Any, list[Any]]] = [(arg, [])]
    while stack:
        value, chain = stack.pop()
        for op, k in _uses(value):
            if op.name == _PRODUCT:
                found.append((op, k, chain))
            elif op.name in VIEWS and len(op.operands) == 1 and len(op.results) == 1:
                stack.append((op.results[0], [*chain, op]))
    return found


def _sites(module: Module, args: Iterable[int]) -> list[tuple[Any, int, Any, list[Any]]]:
    """(product, operand number, argument, chain) for every product after the first that
    reads one of ``args``, in program order within ``@main``'s body."""
    block = module.main.regions[0].blocks[0]
    order = {op.operation: i for i, op in enumerate(block.operations)}
    sites: list[tuple[Any, int, Any, list[Any]]] = []
    for a in sorted(set(args)):
        if a >= len(block.arguments):
            continue
        arg = block.arguments[a]
        found = [
            (op, k, chain)
            for op, k, chain in _products(arg)
            # in @main's own body, reading the parameter on one side only
            if op in order and not _reads(op, 1 - k, arg)
        ]
        found.sort(key=lambda f: order[f[0]])
        sites.extend((op, k, arg, chain) for op, k, chain in found[1:])
    return sites


def _reads(op: Any, k: int, arg: Any) -> bool:
    """Whether operand ``k`` of ``op`` is ``arg`` through view operations."""
    value = op.operands[k]
    while True:
        if value == arg:
            return True
        owner = value.owner
        if isinstance(owner, ir.Block):
            return False
        owner = getattr(owner, "operation", owner)
        if owner.name not in VIEWS or len(owner.operands) != 1:
            return False
        value = owner.operands[0]


def _rewrite(module: Module, args: Iterable[int]) -> int:
    sites = _sites(module, args)
    for op, k, arg, chain in sites:
        other = op.operands[1 - k]
        with ir.InsertionPoint(op), op.location:
            barrier = ir.Operation.create(
                _BARRIER, results=[arg.type, other.type], operands=[arg, other]
            )
            value = barrier.results[0]
            for view in chain:
                copy = view.clone()  # at the insertion point: just before the product
                copy.operands[0] = value
                value = copy.results[0]
        op.operands[k] = value
        op.operands[1 - k] = barrier.results[1]
    return len(sites)


def count_regathers(module: Module, args: Iterable[int]) -> int:
    """How many products ``rewrite_regathers`` would give their own copy of a parameter."""
    with module._ctx:
        return len(_sites(module, args))


def rewrite_regathers(module: Module, args: Iterable[int]) -> int:
    """Give every product after the first that reads one of ``@main``'s arguments
    ``args`` (through ``VIEWS``) its own copy, behind a barrier tied to its other
    operand; in place. The number of products rewritten."""
    with module._ctx:
        done = _rewrite(module, args)
        if done:
            verify(module._module, "a parameter's later products were given their own copies")
    return done
