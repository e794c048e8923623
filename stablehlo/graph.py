"""Reading and extending a parsed StableHLO module: the helpers pattern rewrites share.

Values and their uses, shapes, following converts; a splat's number, and how each element
type holds a number computed on the host (``converted``, ``holds_integers``: what
``mask_values`` computes masks with); and moving the functions of
another module in (named apart, private) and calling them. ``attention.py`` uses them.

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxlib.mlir import ir

from .artifact import Module

__all__ = [
    "COMPARISONS",
    "call",
    "comparison_direction",
    "converted",
    "element_type",
    "dense_integers",
    "FLOAT_BITS",
    "int_range",
    "holds_integers",
    "insert_functions",
    "ints",
    "main_argument",
    "only_user",
    "producer",
    "shape_of",
    "skip_converts",
    "source_of",
    "splat_constant",
    "splat_value",
    "MAX_EVALUATED",
    "uses_of",
]


# ----------------------------------------------------------------- reading the graph
def producer(value: Any) -> Any:
    """The operation that defines ``value``, or None for a block argument."""
    owner = value.owner
    return None if isinstance(owner, ir.Block) else owner.operation


def uses_of(value: Any) -> list[Any]:
    return [u.owner.operation if hasattr(u.owner, "operation") else u.owner for u in value.uses]


def only_user(value: Any, name: str) -> Any:
    users = uses_of(value)
    if len(users) != 1 or users[0].name != name:
        return None
    return users[0]


def main_argument(value: Any) -> int | None:
    """The number of ``@main``'s argument that ``value`` is, or None (an operation's
    result, or the argument of another function's or a region's block)."""
    if producer(value) is not None:
        return None
    arg = ir.BlockArgument(value)
    parent = arg.owner.owner
    parent = getattr(parent, "operation", parent)  # an OpView's .name may be its symbol
    if parent is None or parent.name != "func.func":
        return None
    if ir.StringAttr(parent.attributes["sym_name"]).value != "main":
        return None
    return int(arg.arg_number)


def shape_of(value: Any) -> list[int]:
    return [int(d) for d in ir.RankedTensorType(value.type).shape]


def element_type(value: Any) -> str:
    return str(ir.RankedTensorType(value.type).element_type)


def ints(op: Any, attr: str) -> list[int]:
    return [int(x) for x in ir.DenseI64ArrayAttr(op.attributes[attr])]


FLOATS = frozenset({"f64", "f32", "bf16", "f16"})
"""The element types between which a convert only rounds: the ones skipped."""


def _float_convert(op: Any) -> bool:
    return (
        op is not None
        and op.name == "stablehlo.convert"
        and element_type(op.operands[0]) in FLOATS
        and element_type(op.result) in FLOATS
    )


def skip_converts(value: Any) -> Any:
    """Follow single-use float-to-float converts forward (a convert to an integer or
    another kind of number changes the value: it stops there)."""
    while True:
        nxt = only_user(value, "stablehlo.convert")
        if not _float_convert(nxt):
            return value
        value = nxt.result


def source_of(value: Any) -> Any:
    """Follow float-to-float converts, and broadcasts and reshapes of one element,
    backward to their source (the scalar a splat repeats)."""
    op = producer(value)
    while op is not None and (
        _float_convert(op)
        or (
            op.name in ("stablehlo.broadcast_in_dim", "stablehlo.reshape")
            and math.prod(shape_of(op.operands[0])) == 1
        )
    ):
        value = op.operands[0]
        op = producer(value)
    return value


# ---------------------------------------------------------------- evaluating values
def splat_value(value: Any, scalars: dict[int, float]) -> float | None:
    """The one number ``value`` repeats (a splat constant or a known scalar argument,
    through converts and broadcasts), or None."""
    src = source_of(value)
    op = producer(src)
    if op is None:
        num = main_argument(src)
        return scalars.get(num) if num is not None and shape_of(src) == [] else None
    if op.name != "stablehlo.constant" or not ir.DenseElementsAttr(op.attributes["value"]).is_splat:
        return None
    v = splat_constant(op)
    return None if v is None else float(v)


def splat_constant(op: Any) -> float | bool | int | None:
    """A splat constant's one value, or None (not a splat)."""
    attr = ir.DenseElementsAttr(op.attributes["value"])
    if not attr.is_splat:
        return None
    elem = element_type(op.result)
    if elem == "i1":
        return bool(ir.BoolAttr(attr.get_splat_value()).value)
    if elem.startswith(("f", "bf")):
        return float(ir.FloatAttr(attr.get_splat_value()).value)
    return int(ir.IntegerAttr(attr.get_splat_value()).value)


def comparison_direction(op: Any) -> str:
    """A ``stablehlo.compare``'s direction: "EQ", "LT", ..."""
    return str(op.attributes["comparison_direction"]).split()[-1].rstrip(">")


MAX_EVALUATED = 1 << 20
"""The most elements a value computed at load holds over the dims it varies along
(``mask_values``): a (T, T) mask of T = 1024."""

COMPARISONS: dict[str, Callable[[Any, Any], bool]] = {
    "EQ": lambda a, b: a == b,
    "NE": lambda a, b: a != b,
    "GE": lambda a, b: a >= b,
    "GT": lambda a, b: a > b,
    "LE": lambda a, b: a <= b,
    "LT": lambda a, b: a < b,
}


StateValues = Mapping[int, tuple[str, Callable[[], Sequence[Any] | None]]]
"""@main arguments that are state the step never writes, known when the program is
compiled: argument number -> (state name, a function giving its elements in row-major
order, or None when unknown). A mask read from one (nanoGPT's ``bias`` buffer) is
computed from the value loaded; the caller must see that the state keeps that value
while the program runs."""


FLOAT_BITS = {"f64": 53, "f32": 24, "f16": 11, "bf16": 8}
"""Significand bits of the float types the load's mask computation models: every integer up to
2**bits is exact."""


def int_range(elem: str) -> tuple[int, int] | None:
    """The values a signed (``i8``, ``si8``) or unsigned (``ui8``) integer type holds."""
    m = re.fullmatch(r"(s|u)?i(\d+)", elem)
    if m is None or elem == "i1":
        return None
    bits = int(m.group(2))
    if m.group(1) == "u":
        return 0, (1 << bits) - 1
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def holds_integers(elem: str, n: int) -> bool:
    """Whether the element type holds every integer in [0, n) exactly (an iota of n
    positions): an integer type wide enough, or a float type with enough significand
    bits; False for a type not modelled here."""
    if n <= 0:
        return True
    if elem in FLOAT_BITS:
        return n - 1 <= 1 << FLOAT_BITS[elem]
    span = int_range(elem)
    return span is not None and span[1] >= n - 1


_FORMATS = {
    "f32": (24, -149, 3.4028234663852886e38),
    "f16": (11, -24, 65504.0),
    "bf16": (8, -133, 3.3895313892515355e38),
}
"""Per float type: significand bits, the exponent of its smallest subnormal, its
largest finite value."""


def _round_float(x: float, elem: str) -> float | None:
    """``x`` rounded once to the nearest ``elem`` value (ties to even, subnormals
    included), or None beyond the type's finite range (not modelled)."""
    if elem == "f64" or x == 0.0 or math.isnan(x) or math.isinf(x):
        return x
    bits, tiny, largest = _FORMATS[elem]
    _, e = math.frexp(x)  # |x| = m * 2**e, 0.5 <= m < 1
    step = max(e - bits, tiny)  # the spacing of elem's values around x
    y = math.ldexp(round(math.ldexp(x, -step)), step)  # round(): ties to even
    return None if abs(y) > largest else y


def converted(x: Any, elem: str) -> Any:
    """What ``stablehlo.convert`` makes of the number ``x`` in element type ``elem``:
    ``i1`` is ``x != 0``; a float rounds to nearest; a float becomes an integer by
    truncation toward zero. None where the result is not exact in ``elem``'s own terms
    (an integer out of its range, which XLA would wrap; a float beyond the type's range;
    NaN or infinity to an integer) or ``elem`` is a type not modelled here."""
    if elem == "i1":
        return bool(x)
    if isinstance(x, bool):
        x = int(x)
    if elem in FLOAT_BITS:
        return _round_float(float(x), elem)
    span = int_range(elem)
    if span is None:
        return None
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return None
        x = int(x)  # toward zero
    return x if span[0] <= x <= span[1] else None


def dense_integers(op: Any) -> list[Any] | None:
    """A non-splat integer or boolean constant's elements in row-major order (the
    positions ``torch.arange`` writes), or None for any other."""
    elem = element_type(op.result)
    # unsigned types left out: the bindings read their elements as signed
    if elem != "i1" and (int_range(elem) is None or elem.startswith("ui")):
        return None
    attr = ir.DenseIntElementsAttr(op.attributes["value"])
    values = [attr[i] for i in range(len(attr))]
    return [bool(x) for x in values] if elem == "i1" else [int(x) for x in values]


def insert_functions(module: Module, text: str, prefix: str) -> str:
    """Move ``text``'s functions into ``module`` as private ones named ``prefix``_NAME;
    returns the name its @main got."""
    parsed = Module.parse_text(module, text)._module
    names = [
        ir.StringAttr(op.attributes["sym_name"]).value
        for op in parsed.body.operations
        if "sym_name" in op.attributes
    ]
    for name in names:
        ir.SymbolTable.replace_all_symbol_uses(name, f"{prefix}_{name}", parsed.operation)
    for op in list(parsed.body.operations):
        if "sym_name" not in op.attributes:
            continue
        own = ir.StringAttr(op.attributes["sym_name"]).value
        op.attributes["sym_name"] = ir.StringAttr.get(f"{prefix}_{own}")
        op.attributes["sym_visibility"] = ir.StringAttr.get("private")
        op.detach_from_parent()
        module._module.body.append(op)
    return f"{prefix}_main"


def function_type(module: Module, name: str) -> Any:
    for op in module._module.body.operations:
        if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == name:
            return ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
    raise KeyError(name)


def call(module: Module, name: str, operands: list[Any], before: Any) -> list[Any]:
    ft = function_type(module, name)
    with ir.InsertionPoint(before), before.location:
        call = ir.Operation.create(
            "func.call",
            results=list(ft.results),
            operands=operands,
            attributes={"callee": ir.FlatSymbolRefAttr.get(name)},
        )
    return [call.results[i] for i in range(len(call.results))]
