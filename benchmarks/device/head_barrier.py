"""An experiment, not a runtime rewrite: the output head's input gradient read through an
optimization barrier.

Hugging Face GPT-2 through the torch_xla front-end on the v5e (run 19 of
``results/device/tpu-v5e/attention_table.json``, profiled): one fusion took 15.1 ms of the
84.3 ms step, against 3.6 ms for its counterpart in the hand-written JAX peer and 4.9 ms
in the torch front-end's program. Compiled offline (libtpu 0.0.42.1), it is the head's
input-gradient product ``dlogits (8192 x 50257) @ wte (50257 x 768)`` with the logits'
gradient computed inside it from the bf16 logits and the targets, and with the final
LayerNorm's backward and the whole residual stream (24 additions of the layers' outputs,
recomputed rather than kept from the forward) fused after it, 13 activation-sized float32
results in all; libtpu's cost model prices it at 38.2M cycles.

``rewrite_head_barriers`` puts a ``stablehlo.optimization_barrier`` on the result of each
product that contracts over at least ``MIN_CONTRACTED`` elements (a vocabulary) into a
result smaller than its contracted operand: XLA can then fuse nothing that reads the
product's result into the product. The barrier is the identity on values, so the
program computes the same numbers; only the chip can say whether it is faster.
``attention_table.py``'s ``head-barrier`` experiment and ``torch_frontend_hlo.py
compile --variant head-barrier`` run it.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.
"""

from __future__ import annotations

import math
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from stepbundle.stablehlo.artifact import Module
from stepbundle.stablehlo.build import verify

__all__ = ["MIN_CONTRACTED", "count_head_barriers", "head_barrier_text", "rewrite_head_barriers"]

MIN_CONTRACTED = 16384
"""The least number of elements a product must sum over to be a head's input gradient."""


def _is_head_gradient(op: Any, operands: bool) -> bool:
    if op.name != "stablehlo.dot_general":
        return False
    if operands and any(
        max(ir.RankedTensorType(v.type).shape, default=0) >= MIN_CONTRACTED
        for v in [*op.operands, op.result]
    ):
        return "stablehlo.optimization_barrier" not in [u.owner.name for u in op.result.uses]
    dn = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    lhs = ir.RankedTensorType(op.operands[0].type)
    out = ir.RankedTensorType(op.result.type)
    contracted = math.prod(lhs.shape[d] for d in dn.lhs_contracting_dimensions)
    uses = [u.owner.name for u in op.result.uses]
    return (
        contracted >= MIN_CONTRACTED
        and math.prod(out.shape) < math.prod(lhs.shape)
        and "stablehlo.optimization_barrier" not in uses
    )


def _sites(module: Any, operands: bool) -> list[Any]:
    sites: list[Any] = []
    stack = [module.operation]
    while stack:
        op = stack.pop()
        if _is_head_gradient(op, operands):
            sites.append(op)
        for region in op.regions:
            for block in region.blocks:
                stack.extend(o.operation for o in block.operations)
    return sites


def _after(op: Any) -> Any:
    """An insertion point just after ``op`` (older jaxlibs have no
    ``InsertionPoint.after``)."""
    if hasattr(ir.InsertionPoint, "after"):
        return ir.InsertionPoint.after(op)
    ops = list(op.operation.block.operations)
    at = next(i for i, o in enumerate(ops) if o.operation == op.operation)
    return ir.InsertionPoint(ops[at + 1])  # a product is never its block's terminator


def _insert(module: Any, operands: bool) -> int:
    sites = _sites(module, operands)
    for op in sites:
        with _after(op), op.location:
            barrier = ir.Operation.create(
                "stablehlo.optimization_barrier",
                results=[op.result.type],
                operands=[op.result],
            )
        for use in list(op.result.uses):
            if use.owner != barrier:
                use.owner.operands[use.operand_number] = barrier.result
        if operands:
            with ir.InsertionPoint(op), op.location:
                for i, operand in enumerate(list(op.operands)):
                    held = ir.Operation.create(
                        "stablehlo.optimization_barrier",
                        results=[operand.type],
                        operands=[operand],
                    )
                    op.operands[i] = held.result
    return len(sites)


def count_head_barriers(module: Module, operands: bool = False) -> int:
    """The products of ``module`` that ``rewrite_head_barriers`` would put a barrier on."""
    with module._ctx:
        return len(_sites(module._module, operands))


def rewrite_head_barriers(module: Module, operands: bool = False) -> int:
    """Put the barriers in, in place; the number of products."""
    with module._ctx:
        done = _insert(module._module, operands)
        if done:
            verify(module._module, "barriers on the head's input gradients")
    return done


def head_barrier_text(text: str, operands: bool = False) -> tuple[str, int]:
    """The same on a module's text (``torch_frontend_hlo.py``'s variants); the caller holds
    an MLIR context with the StableHLO dialect loaded."""
    module = ir.Module.parse(text)
    done = _insert(module, operands)
    assert module.operation.verify()
    return str(module), done
