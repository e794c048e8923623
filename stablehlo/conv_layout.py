"""Convolutions in the dimension order XLA:CPU's fast kernels take, everywhere in a module.

XLA's CPU compiler runs a convolution as an Eigen kernel when its operands are in NHWC /
HWIO order (batch, spatial..., feature; spatial..., input feature, output feature), and
its ``ConvCanonicalization`` pass puts every other convolution in that order with
transposes around it, but only in the entry computation. A convolution inside a
``stablehlo.while`` body (``runtime/compile/multistep.py``'s K-step loop) keeps its order and
runs XLA's generic convolution loop instead, which sums in another order: measured, a
small CNN's loss 1 ulp apart from a single step's at step 1.

``canonicalize_convolutions`` applies the same rewrite to every convolution of a module
up front, so the loop body's convolutions are the ones the single step runs:

    transpose(input, [batch, spatial..., feature])
    transpose(kernel, [spatial..., input feature, output feature])
    convolution(...) with dimension numbers [b, 0, 1, ..., f]x[0, 1, ..., i, o]->[b, 0, 1, ..., f]
    transpose(result, inverse of [batch, spatial..., feature])

The window attributes (strides, padding, dilations, reversal) name spatial dimensions in
their order, which the rewrite keeps, so they carry over unchanged. A transpose moves
values without arithmetic: the result is the original convolution's.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.artifact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from .artifact import Module, ProgramError

hlo: Any = _stablehlo  # jaxlib's stubs do not cover the dialect's attribute classes

__all__ = ["canonicalize_convolutions"]


def _transpose(value: Any, permutation: Sequence[int]) -> Any:
    t = ir.RankedTensorType(value.type)
    shape = [t.shape[p] for p in permutation]
    op = ir.Operation.create(
        "stablehlo.transpose",
        results=[ir.RankedTensorType.get(shape, t.element_type)],
        operands=[value],
        attributes={"permutation": ir.DenseI64ArrayAttr.get(list(permutation))},
    )
    return op.result


def _inverse(permutation: Sequence[int]) -> list[int]:
    out = [0] * len(permutation)
    for i, p in enumerate(permutation):
        out[p] = i
    return out


def canonicalize_convolutions(module: Module) -> int:
    """Rewrite every ``stablehlo.convolution`` of ``module`` into NHWC/HWIO order, in place
    (every function and nested region). Returns the number rewritten; one already in that
    order is left alone.

    Raises:
      ValueError: a convolution has a dynamic shape, or the module does not verify after.
    """
    ctx = module._ctx
    targets = [op for op in module._operations() if op.name == "stablehlo.convolution"]
    done = 0
    with ctx:
        for op in targets:
            dn = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
            spatial = len(list(dn.input_spatial_dimensions))
            rank = spatial + 2
            perm_in = [dn.input_batch_dimension, *dn.input_spatial_dimensions]
            perm_in.append(dn.input_feature_dimension)
            perm_k = [*dn.kernel_spatial_dimensions, dn.kernel_input_feature_dimension]
            perm_k.append(dn.kernel_output_feature_dimension)
            perm_out = [dn.output_batch_dimension, *dn.output_spatial_dimensions]
            perm_out.append(dn.output_feature_dimension)
            identity = list(range(rank))
            if perm_in == identity and perm_k == identity and perm_out == identity:
                continue
            out_t = ir.RankedTensorType(op.results[0].type)
            for v in (*op.operands, op.results[0]):
                if any(ir.ShapedType.is_dynamic_size(d) for d in ir.RankedTensorType(v.type).shape):
                    raise ProgramError(f"a convolution has an operand of dynamic shape {v.type}")
            canonical = hlo.ConvDimensionNumbers.get(
                input_batch_dimension=0,
                input_feature_dimension=rank - 1,
                input_spatial_dimensions=list(range(1, rank - 1)),
                kernel_input_feature_dimension=rank - 2,
                kernel_output_feature_dimension=rank - 1,
                kernel_spatial_dimensions=list(range(rank - 2)),
                output_batch_dimension=0,
                output_feature_dimension=rank - 1,
                output_spatial_dimensions=list(range(1, rank - 1)),
            )
            names = [a if isinstance(a, str) else a.name for a in op.attributes]
            attributes = {n: op.attributes[n] for n in names}
            attributes["dimension_numbers"] = canonical
            with ir.InsertionPoint(op), op.location:
                x = _transpose(op.operands[0], perm_in)
                k = _transpose(op.operands[1], perm_k)
                shape = [out_t.shape[p] for p in perm_out]
                conv = ir.Operation.create(
                    "stablehlo.convolution",
                    results=[ir.RankedTensorType.get(shape, out_t.element_type)],
                    operands=[x, k],
                    attributes=attributes,
                )
                back = _transpose(conv.result, _inverse(perm_out))
            op.results[0].replace_all_uses_with(back)
            op.erase()
            done += 1
        if done and not module._module.operation.verify():
            raise ProgramError("the module does not verify after reordering its convolutions")
    return done
