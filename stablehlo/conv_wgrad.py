"""Weight-gradient convolutions in a form the TPU compiler handles: a loop over rows.

A convolution layer's weight gradient is itself a convolution whose *window* is the
whole activation map and whose *output* is the small filter: torch_xla writes it as

    convolution(x, dy) dim_numbers = [f, b, 0, 1]x[i, o, 0, 1]->[0, 1, b, f],
        window = {pad = [[1, 1], [1, 1]]}
        : (tensor<64x3x32x32xf32>, tensor<64x8x32x32xf32>) -> tensor<3x3x3x8xf32>

(jax writes the same computation in other orders, e.g. ``[f, 0, 1, b]x[i, 0, 1, o]->
[0, 1, b, f]`` for NHWC). **This is what the TPU compiler is slow on**: it emits such a
convolution with its map-sized window (32x32 here) unrolled, and takes far longer over
that code than its size suggests: examples/cifar_cnn.py's train program took over ten
times its eval program's compile time on a TPU v5e, nearly all of it in these
convolutions (docs/tpu.md, "Compile time: a CNN's train program", has the figures; found with
``benchmarks/device/compile_bisect.py`` and ``compile_offline.py``).

``rewrite_weight_gradients`` writes each as a ``stablehlo.while`` loop over the first
spatial dimension of its kernel operand (``dy``): for a stride-1, undilated, ungrouped
convolution

    out[s, t] = sum over k of  sum over u of  pad(x)[s + k, t + u] * dy[k, u]

so iteration ``k`` convolves a slab of the padded input (rows ``k .. k + out rows``) with
row ``k`` of ``dy`` (with the original padding along the other dimensions) and adds it
to the result: the same convolution, with a window of one row (several rows where rows
are short, up to ``ROW_WINDOW`` elements; a row longer than that stays whole, e.g. 64
elements for a 64x64 map). A bf16 or f16 result is summed in float32 and rounded once,
as XLA's convolution does (summed in its own type, the first CNN layer's bf16 weight
gradient was 3x further from float64). The CNN's train program then compiles in about
twice its eval program's time (docs/tpu.md).

Before this, the runtime wrote one ``dot_general`` per output position (``form=
"positions"``, kept for ``compile_variants.py``). XLA turns each product back into a
convolution with the map-sized window, most of the program's code (docs/tpu.md).

The sum is the same in another order (float rounding differs), so the rewrite runs
only where it was measured to matter: the runtime applies it on TPUs. A convolution is
rewritten when its output has at most ``MAX_POSITIONS`` spatial positions and fewer than
its window has (a filter-sized result of a map-sized window), its window has more than
``ROW_WINDOW`` elements and more than one row (a loop of one iteration would change
nothing: a ``Conv1d``'s 1xL map, or a convolution the rewrite already made); grouped
(depthwise), strided, dilated and reversed convolutions never are. The rule reads
shapes, not which convolution of the step it is: a forward or input-gradient
convolution with the usual small filter (a 3x3 window) is left alone, but one whose
filter is as large as its map, so that its window is map-sized and its output a few
positions (an 8x8 kernel over an 8x8 map: one position, a window of 64), is rewritten
too. It is the same sum, and the same map-sized window the TPU compiler unrolls
(``tests/runtime/test_conv_wgrad.py`` pins both).

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.artifact.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from stepbundle.schema.errors import UsageError

from .artifact import Module, ProgramError
from .build import i64s, splat
from .build import op as build_op

hlo: Any = _stablehlo  # jaxlib's stubs do not cover the dialect's attribute classes

__all__ = ["MAX_POSITIONS", "count_weight_gradients", "rewrite_weight_gradients"]

MAX_POSITIONS = 49
"""The most output positions (7x7 filters) a rewritten convolution may have."""

ROW_WINDOW = 32
"""The most kernel-operand elements one iteration of the row loop convolves over (a
convolution whose whole window is this small is left alone)."""


def _flat(attr: Any) -> list[Any]:
    """The values of an array attribute (``array<i64: ...>``) or of a dense elements one
    (``dense<...> : tensor<2x2xi64>``, row-major), without numpy (this layer has none)."""
    # Casting by construction works on every jaxlib: the static ``isinstance`` these classes
    # had is gone from the bindings jax 0.10 ships, and the implicit downcast is not in 0.7.
    for kind in (ir.DenseI64ArrayAttr, ir.DenseBoolArrayAttr):
        try:
            return list(kind(attr))
        except (ValueError, TypeError):
            continue
    dense = ir.DenseIntElementsAttr(attr)
    if dense.is_splat:
        n = math.prod(ir.ShapedType(dense.type).shape)
        return [ir.IntegerAttr(dense.get_splat_value()).value] * n
    return [dense[i] for i in range(len(dense))]


def _ints(op: Any, name: str, default: Sequence[int]) -> list[int]:
    if name not in op.attributes:
        return list(default)
    return [int(v) for v in _flat(op.attributes[name])]


def _bools(op: Any, name: str, n: int) -> list[bool]:
    if name not in op.attributes:
        return [False] * n
    return [bool(v) for v in _flat(op.attributes[name])]


def _eligible(op: Any, dn: Any) -> list[tuple[int, int]] | None:
    """The padding per spatial dimension if ``op`` is a weight gradient to rewrite."""
    spatial = len(list(dn.input_spatial_dimensions))
    if int(ir.IntegerAttr(op.attributes["feature_group_count"]).value) != 1:
        return None
    if int(ir.IntegerAttr(op.attributes["batch_group_count"]).value) != 1:
        return None
    ones = [1] * spatial
    for name in ("window_strides", "lhs_dilation", "rhs_dilation"):
        if _ints(op, name, ones) != ones:
            return None
    if any(_bools(op, "window_reversal", spatial)):
        return None
    flat = _ints(op, "padding", [0] * (2 * spatial))
    padding = [(flat[2 * j], flat[2 * j + 1]) for j in range(spatial)]
    if any(lo < 0 or hi < 0 for lo, hi in padding):
        return None
    for v in (*op.operands, op.results[0]):
        if any(ir.ShapedType.is_dynamic_size(d) for d in ir.RankedTensorType(v.type).shape):
            return None
    out = ir.RankedTensorType(op.results[0].type).shape
    kernel = ir.RankedTensorType(op.operands[1].type).shape
    positions = math.prod(out[d] for d in dn.output_spatial_dimensions)
    window = math.prod(kernel[d] for d in dn.kernel_spatial_dimensions)
    # A window of at most ROW_WINDOW elements is no trouble to the compiler; one of a
    # single row is what the loop below leaves (so a rewritten convolution is never taken
    # again), and looping over one row would change nothing.
    rows = kernel[list(dn.kernel_spatial_dimensions)[0]]
    if positions > MAX_POSITIONS or positions >= window or window <= ROW_WINDOW or rows == 1:
        return None
    return padding


def _targets(module: Module) -> list[tuple[Any, Any, list[tuple[int, int]]]]:
    """Every weight-gradient convolution to rewrite: (op, dimension numbers, padding)."""
    out = []
    with module._ctx:
        for op in module._operations():
            if op.name == "stablehlo.convolution":
                dn = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
                padding = _eligible(op, dn)
                if padding is not None:
                    out.append((op, dn, padding))
    return out


def count_weight_gradients(module: Module) -> int:
    """How many convolutions of ``module`` ``rewrite_weight_gradients`` would rewrite."""
    return len(_targets(module))


def rewrite_weight_gradients(module: Module, form: str = "rows") -> int:
    """Rewrite every weight-gradient convolution of ``module`` in place: as a loop over
    rows (``form="rows"``) or as one matrix product per output position
    (``"positions"``, the form before; see the module docstring). Returns the number
    rewritten.

    Raises:
      ValueError: the module does not verify after the rewrite, or an unknown ``form``.
    """
    if form not in ("rows", "positions"):
        raise UsageError(f"form must be 'rows' or 'positions', not {form!r}")
    targets = _targets(module)
    with module._ctx:
        for op, dn, padding in targets:
            (_rewrite_rows if form == "rows" else _rewrite_positions)(op, dn, padding)
        if targets and not module._module.operation.verify():
            raise ProgramError("the module does not verify after rewriting weight gradients")
    return len(targets)


def _t(shape: list[int], elem: Any) -> Any:
    return ir.RankedTensorType.get(shape, elem)


def _rewrite_positions(op: Any, dn: Any, padding: list[tuple[int, int]]) -> None:
    """One ``dot_general`` per output position: the window at that position (a slice of
    the padded input) times the whole kernel operand; the results stacked."""
    x, k = op.operands[0], op.operands[1]
    x_t, k_t = ir.RankedTensorType(x.type), ir.RankedTensorType(k.type)
    out_t = ir.RankedTensorType(op.results[0].type)
    rank = x_t.rank
    in_sp = list(dn.input_spatial_dimensions)
    k_sp = list(dn.kernel_spatial_dimensions)
    out_sp = list(dn.output_spatial_dimensions)
    batch = x_t.shape[dn.input_batch_dimension]
    features = k_t.shape[dn.kernel_output_feature_dimension]
    window = [k_t.shape[d] for d in k_sp]
    positions = [out_t.shape[d] for d in out_sp]

    def dot_attrs() -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "dot_dimension_numbers": hlo.DotDimensionNumbers.get(
                lhs_batching_dimensions=[],
                rhs_batching_dimensions=[],
                lhs_contracting_dimensions=[dn.input_feature_dimension, *in_sp],
                rhs_contracting_dimensions=[dn.kernel_input_feature_dimension, *k_sp],
            )
        }
        if "precision_config" in op.attributes:
            attrs["precision_config"] = op.attributes["precision_config"]
        return attrs

    et = out_t.element_type
    with ir.InsertionPoint(op), op.location:
        low, high = [0] * rank, [0] * rank
        for j, d in enumerate(in_sp):
            low[d], high[d] = padding[j]
        padded_shape = [x_t.shape[d] + low[d] + high[d] for d in range(rank)]
        xp = x
        if any(low) or any(high):
            xp = build_op(
                "stablehlo.pad",
                ir.RankedTensorType.get(padded_shape, x_t.element_type),
                [x, splat([], x_t.element_type, 0)],
                edge_padding_low=i64s(low),
                edge_padding_high=i64s(high),
                interior_padding=i64s([0] * rank),
            )
        rows = []
        for at in itertools.product(*(range(n) for n in positions)):
            start, limit = [0] * rank, list(padded_shape)
            for j, d in enumerate(in_sp):
                start[d], limit[d] = at[j], at[j] + window[j]
            shape = [b - a for a, b in zip(start, limit)]
            window_at = build_op(
                "stablehlo.slice",
                _t(shape, x_t.element_type),
                [xp],
                start_indices=i64s(start),
                limit_indices=i64s(limit),
                strides=i64s([1] * rank),
            )
            dot = build_op(
                "stablehlo.dot_general", _t([batch, features], et), [window_at, k], **dot_attrs()
            )
            rows.append(build_op("stablehlo.reshape", _t([1, batch, features], et), [dot]))
        dim = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 0)
        n = len(rows)
        product = (
            rows[0]
            if n == 1
            else build_op(
                "stablehlo.concatenate", _t([n, batch, features], et), rows, dimension=dim
            )
        )
        grid = build_op(
            "stablehlo.reshape",
            ir.RankedTensorType.get([*positions, batch, features], et),
            [product],
        )
        # grid is (spatial..., batch, feature); put each in the convolution's output place.
        perm = [0] * rank
        for j, d in enumerate(out_sp):
            perm[d] = j
        perm[dn.output_batch_dimension] = len(out_sp)
        perm[dn.output_feature_dimension] = len(out_sp) + 1
        result = build_op("stablehlo.transpose", out_t, [grid], permutation=i64s(perm))
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _rows_per_iteration(rows: int, per_row: int) -> int:
    """The most rows of the kernel operand one iteration takes: a divisor of ``rows``
    whose window (rows x ``per_row`` elements) stays within ``ROW_WINDOW``."""
    best = 1
    for r in range(1, rows + 1):
        if rows % r == 0 and r * per_row <= ROW_WINDOW:
            best = r
    return best


def _rewrite_rows(op: Any, dn: Any, padding: list[tuple[int, int]]) -> None:
    """The convolution as a loop over its kernel operand's first spatial dimension: each
    iteration convolves a slab of the padded input with a few rows of the kernel operand
    (a window of at most ``ROW_WINDOW`` elements) and adds it to the result."""
    x, k = op.operands[0], op.operands[1]
    x_t, k_t = ir.RankedTensorType(x.type), ir.RankedTensorType(k.type)
    out_t = ir.RankedTensorType(op.results[0].type)
    rank = x_t.rank
    d_in = list(dn.input_spatial_dimensions)[0]
    d_k = list(dn.kernel_spatial_dimensions)[0]
    d_out = list(dn.output_spatial_dimensions)[0]
    rows = k_t.shape[d_k]
    per_row = math.prod(k_t.shape[d] for d in list(dn.kernel_spatial_dimensions)[1:])
    r = _rows_per_iteration(rows, per_row)
    n = rows // r
    with ir.InsertionPoint(op), op.location:
        # bf16/f16 results are summed in float32 and rounded once, after the loop.
        narrow = str(out_t.element_type) in ("bf16", "f16")
        et = ir.F32Type.get() if narrow else out_t.element_type
        acc_t = _t(list(out_t.shape), et)
        i32 = ir.IntegerType.get_signless(32)
        scalar = ir.RankedTensorType.get([], i32)
        low, high = [0] * rank, [0] * rank
        low[d_in], high[d_in] = padding[0]
        padded = list(x_t.shape)
        padded[d_in] += padding[0][0] + padding[0][1]
        xp = x
        if padding[0] != (0, 0):
            xp = build_op(
                "stablehlo.pad",
                _t(padded, x_t.element_type),
                [x, splat([], x_t.element_type, 0)],
                edge_padding_low=i64s(low),
                edge_padding_high=i64s(high),
                interior_padding=i64s([0] * rank),
            )
        xp_t = ir.RankedTensorType(xp.type)
        init = [splat([], i32, 0), splat(list(out_t.shape), et, 0), xp, k]
        types = [scalar, acc_t, xp_t, k_t]
        loop = ir.Operation.create("stablehlo.while", results=types, operands=init, regions=2)
        cond = loop.regions[0].blocks.append(*types)
        with ir.InsertionPoint(cond):
            lt = ir.Attribute.parse("#stablehlo<comparison_direction LT>")
            i1 = ir.RankedTensorType.get([], ir.IntegerType.get_signless(1))
            less = build_op(
                "stablehlo.compare",
                i1,
                [cond.arguments[0], splat([], i32, n)],
                comparison_direction=lt,
            )
            ir.Operation.create("stablehlo.return", results=[], operands=[less])
        body = loop.regions[1].blocks.append(*types)
        with ir.InsertionPoint(body):
            i, acc, xb, kb = (body.arguments[j] for j in range(4))
            start = build_op("stablehlo.multiply", scalar, [i, splat([], i32, r)])
            zero = splat([], i32, 0)
            slab_shape = list(padded)
            slab_shape[d_in] = out_t.shape[d_out] + r - 1
            slab = build_op(
                "stablehlo.dynamic_slice",
                _t(slab_shape, x_t.element_type),
                [xb, *[start if d == d_in else zero for d in range(rank)]],
                slice_sizes=i64s(slab_shape),
            )
            part_shape = list(k_t.shape)
            part_shape[d_k] = r
            part = build_op(
                "stablehlo.dynamic_slice",
                _t(part_shape, k_t.element_type),
                [kb, *[start if d == d_k else zero for d in range(rank)]],
                slice_sizes=i64s(part_shape),
            )
            # Iterating the attributes yields names or NamedAttributes, by jaxlib release.
            names = [a if isinstance(a, str) else a.name for a in op.attributes]
            attrs = {name: op.attributes[name] for name in names}
            pads = ", ".join(f"[{lo}, {hi}]" for lo, hi in [(0, 0), *padding[1:]])
            attrs["padding"] = ir.Attribute.parse(f"dense<[{pads}]> : tensor<{len(padding)}x2xi64>")
            conv = ir.Operation.create(
                "stablehlo.convolution", results=[acc_t], operands=[slab, part], attributes=attrs
            ).result
            total = build_op("stablehlo.add", acc_t, [acc, conv])
            nxt = build_op("stablehlo.add", scalar, [i, splat([], i32, 1)])
            ir.Operation.create("stablehlo.return", results=[], operands=[nxt, total, xb, kb])
        result = loop.results[1]
        if narrow:
            result = build_op("stablehlo.convert", out_t, [result])
    op.results[0].replace_all_uses_with(result)
    op.erase()
