"""Building StableHLO operations in place: the few constructors the rewrites share.

``conv_wgrad.py`` and ``pow_precision.py`` insert new operations into a parsed module
through jaxlib's generic ``ir.Operation.create``, not the dialect's generated builders,
whose signatures have changed between jaxlib releases. Call them inside the module's
context, an insertion point and a location.

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxlib.mlir import ir

from .artifact import ProgramError

__all__ = ["i64s", "op", "splat", "verify"]


def op(name: str, result_type: Any, operands: Sequence[Any], **attributes: Any) -> Any:
    """One operation ``name`` with one result of ``result_type``; returns the result."""
    return ir.Operation.create(
        name, results=[result_type], operands=list(operands), attributes=attributes
    ).result


def i64s(values: Sequence[int]) -> Any:
    """An ``array<i64: ...>`` attribute (slice bounds, paddings, permutations)."""
    return ir.DenseI64ArrayAttr.get([int(v) for v in values])


def splat(shape: Sequence[int], element_type: Any, value: float) -> Any:
    """A ``stablehlo.constant`` of ``shape`` filled with ``value`` (an integer type gets
    ``int(value)``)."""
    t = ir.RankedTensorType.get(list(shape), element_type)
    scalar: Any = (
        ir.FloatAttr.get(element_type, float(value))
        if str(element_type).startswith(("f", "bf"))
        else ir.IntegerAttr.get(element_type, int(value))
    )
    return op("stablehlo.constant", t, [], value=ir.DenseElementsAttr.get_splat(t, scalar))


def verify(module: Any, after: str) -> None:
    """Check a module after a rewrite (``after``: what it did, for the message).

    Raises:
      ValueError: it does not verify (jaxlib raises MLIRError where older ones return
        False; both become this).
    """
    try:
        ok = module.operation.verify()
    except Exception as e:
        raise ProgramError(f"the module does not verify after {after}: {e}") from e
    if not ok:
        raise ProgramError(f"the module does not verify after {after}")
