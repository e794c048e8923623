"""Weight-gradient convolutions as matrix products, for the TPU compiler.

A convolution layer's weight gradient is itself a convolution whose *window* is the
whole activation map and whose *output* is the small filter: torch_xla writes it as

    convolution(x, dy) dim_numbers = [f, b, 0, 1]x[i, o, 0, 1]->[0, 1, b, f],
        window = {pad = [[1, 1], [1, 1]]}
        : (tensor<64x3x32x32xf32>, tensor<64x8x32x32xf32>) -> tensor<3x3x3x8xf32>

(jax writes the same computation with the output ``[f, b, 0, 1]``). On a TPU v5e with
jax 0.10.2, examples/cifar_cnn.py's train program took 45-61 s to compile against 2.5-5.9
s for its eval program (``benchmarks/device/compile_bisect.py``; results in
``benchmarks/results/device/tpu-v5e/bisect*.json``, variants compiled side by side):

- the three weight-gradient convolutions replaced by zeros: 6.3-6.6 s; the input-gradient
  convolutions, the max-pool gradients or the pooling removed instead: no change; the
  weight gradients' output written ``[f, b, 0, 1]``, or every convolution put in
  NHWC/HWIO order: no change. The weight gradients are the cause.
- them rewritten as below: 57.0 s alone, **7.6 s** together with the Philox pin of the
  program's random bits (``rng_algorithm.py``), which alone gives 56.7 s. The TPU's own
  DEFAULT random-bit expansion and these products together still defeat its compiler;
  the runtime applies both, and the program loaded through it compiles in 5.0-7.1 s.

``rewrite_weight_gradients`` computes such a convolution as one ``dot_general`` per
output position: for a stride-1, undilated, ungrouped convolution

    out[b, o, s] = sum over i, k of pad(lhs)[b, i, s + k] * rhs[i, o, k]

so output position ``s`` is the product of the padded input's window at ``s`` (a
slice) with the whole kernel operand, contracting the input feature and every spatial
dimension. The results, ``[batch, out feature]`` each, are stacked and put in the
convolution's output order. ``stacked=True`` stacks the windows instead and takes one
product: it compiled no faster (train 3.9-5.5 s against 2.4-5.1 s per position, 3 rounds
each in one process; compile_variants-wgrad-stacked.json), so it is not the default.
It is the same sum in another order (float rounding
differs), so it runs only where it was measured to matter: the runtime applies it on
TPUs. A convolution is rewritten when its output has at most ``MAX_POSITIONS`` spatial
positions and fewer than its window has (a filter-sized result of a map-sized window);
a forward or input-gradient convolution, whose window is the small filter, never is.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.artifact.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from .artifact import Module
from .build import i64s, splat
from .build import op as build_op

hlo: Any = _stablehlo  # jaxlib's stubs do not cover the dialect's attribute classes

__all__ = ["MAX_POSITIONS", "rewrite_weight_gradients"]

MAX_POSITIONS = 49
"""The most output positions (7x7 filters) a rewritten convolution may have: one matrix
product each."""


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
    if positions > MAX_POSITIONS or positions >= window:
        return None
    return padding


def rewrite_weight_gradients(module: Module, stacked: bool = False) -> int:
    """Rewrite every weight-gradient convolution of ``module`` (see the module docstring)
    into matrix products, in place. Returns the number rewritten. ``stacked=True`` writes
    the windows stacked into one product instead (tried; see the module docstring).

    Raises:
      ValueError: the module does not verify after the rewrite.
    """
    targets = [op for op in module._operations() if op.name == "stablehlo.convolution"]
    done = 0
    with module._ctx:
        for op in targets:
            dn = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
            padding = _eligible(op, dn)
            if padding is None:
                continue
            _rewrite(op, dn, padding, stacked)
            done += 1
        if done and not module._module.operation.verify():
            raise ValueError("the module does not verify after rewriting weight gradients")
    return done


def _t(shape: list[int], elem: Any) -> Any:
    return ir.RankedTensorType.get(shape, elem)


def _concat(pieces: list[Any], shape: list[int], elem: Any) -> Any:
    if len(pieces) == 1:
        return pieces[0]
    dim = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 0)
    return build_op("stablehlo.concatenate", _t(shape, elem), pieces, dimension=dim)


def _rewrite(op: Any, dn: Any, padding: list[tuple[int, int]], stacked: bool) -> None:
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

    def dot_attrs(lead: int) -> dict[str, Any]:
        """The product's attributes, its lhs having ``lead`` dimensions before the
        input's (1 for the stacked windows)."""
        attrs: dict[str, Any] = {
            "dot_dimension_numbers": hlo.DotDimensionNumbers.get(
                lhs_batching_dimensions=[],
                rhs_batching_dimensions=[],
                lhs_contracting_dimensions=[lead + d for d in (dn.input_feature_dimension, *in_sp)],
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
        # One product per window (default), or the windows stacked into one product.
        slices = []
        for at in itertools.product(*(range(n) for n in positions)):
            start, limit = [0] * rank, list(padded_shape)
            for j, d in enumerate(in_sp):
                start[d], limit[d] = at[j], at[j] + window[j]
            shape = [b - a for a, b in zip(start, limit)]
            slices.append(
                build_op(
                    "stablehlo.slice",
                    _t(shape, x_t.element_type),
                    [xp],
                    start_indices=i64s(start),
                    limit_indices=i64s(limit),
                    strides=i64s([1] * rank),
                )
            )
        n = len(slices)
        if stacked:
            one = [
                build_op("stablehlo.reshape", _t([1, *shape], x_t.element_type), [w])
                for w in slices
            ]
            windows = _concat(one, [n, *shape], x_t.element_type)
            product = build_op(
                "stablehlo.dot_general", _t([n, batch, features], et), [windows, k], **dot_attrs(1)
            )
        else:  # one product per window, their [batch, feature] results stacked
            rows = [
                build_op(
                    "stablehlo.reshape",
                    _t([1, batch, features], et),
                    [
                        build_op(
                            "stablehlo.dot_general",
                            _t([batch, features], et),
                            [w, k],
                            **dot_attrs(0),
                        )
                    ],
                )
                for w in slices
            ]
            product = _concat(rows, [n, batch, features], et)
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
