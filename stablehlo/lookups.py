"""Which of ``@main``'s arguments a program looks rows up in, and along which dimensions.

An embedding is a ``stablehlo.gather`` of whole rows of a table (its ``start_index_map``
dimension, slice size 1) at the token ids. Where a parallel layout splits the table over
the same mesh axis as the batch (``fsdp``: the ``data`` axis) on a dimension the gather
indexes, XLA's SPMD partitioner cannot look the rows up where they live: it gathers the
whole table onto every device for the lookup (float32, as the table is stored) and
reduces the lookup's gradient, a scatter into a whole table of zeros, with an all-reduce
of the whole table (#41: 1.96 GiB each for an 8B's 128,256 x 4,096 embedding, on every
chip of a v5e-256). Split on a dimension the gather takes whole (the width), the
partitioner gathers the token ids instead, looks up every token's columns on each device,
and the table and its gradient stay split (``runtime/placement/shard_plan.py``).

``lookup_dims(module)`` follows each gather's operand back through float converts and
the arguments of private functions (at every call) to ``@main``'s arguments.

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from .artifact import Module
from .graph import _float_convert, ints, main_argument, producer, shape_of

__all__ = ["lookup_dims"]

stablehlo: Any = _stablehlo  # untyped bindings


def _calls(module: Module) -> dict[str, list[Any]]:
    """Private function name -> the ``func.call`` operations that call it."""
    found: dict[str, list[Any]] = {}
    for op in module._operations():
        if op.name == "func.call":
            callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
            found.setdefault(callee, []).append(op)
    return found


def _arguments(value: Any, calls: dict[str, list[Any]], depth: int = 0) -> set[int]:
    """The ``@main`` arguments ``value`` is (through float converts and calls)."""
    op = producer(value)
    while op is not None and _float_convert(op):
        value = op.operands[0]
        op = producer(value)
    if op is not None:
        return set()
    arg = main_argument(value)
    if arg is not None:
        return {arg}
    if depth > 16:  # deeper nesting of calls than any front-end writes: not followed
        return set()
    block_arg = ir.BlockArgument(value)
    func = block_arg.owner.owner
    func = getattr(func, "operation", func)
    if func is None or func.name != "func.func":
        return set()  # a region's own argument (a reduce's body, a loop's)
    name = ir.StringAttr(func.attributes["sym_name"]).value
    found: set[int] = set()
    for call in calls.get(name, []):
        found |= _arguments(call.operands[block_arg.arg_number], calls, depth + 1)
    return found


def lookup_dims(module: Module) -> dict[int, frozenset[int]]:
    """``@main``'s argument number -> the dimensions a gather indexes in it (the
    ``start_index_map`` dimensions it takes less than whole), for every argument some
    gather reads."""
    out: dict[int, set[int]] = {}
    with module._ctx:
        calls = _calls(module)
        for op in module._operations():
            if op.name != "stablehlo.gather":
                continue
            operand = op.operands[0]
            shape, sizes = shape_of(operand), ints(op, "slice_sizes")
            numbers = stablehlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
            dims = {int(d) for d in numbers.start_index_map if sizes[int(d)] < shape[int(d)]}
            if not dims:
                continue
            for arg in _arguments(operand, calls):
                out.setdefault(arg, set()).update(dims)
    return {arg: frozenset(d) for arg, d in out.items()}
