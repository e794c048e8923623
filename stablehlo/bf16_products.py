"""bf16 products written float32-out and then rounded, as bf16-out products; the weight
gradients among them in the operand order torch_xla writes.

The torch front-end writes a bf16 x bf16 matrix product as PyTorch computes it on the
CPU: accumulated in float32 and rounded to bf16 once, ``convert(dot_general(a, b) -> f32)
-> bf16``. torch_xla writes the same product ``dot_general(a, b) -> bf16``. On a TPU v5e
the two gave the same bits: five products of a transformer's layers' shapes (summing up to
8,192 elements), compiled both ways, agreed on every element
(``benchmarks/results/device/tpu-v5e/bf16_products_bits.json``; the matrix unit
accumulates in float32 and rounds once on the way out). Longer sums (an output head's
input gradient sums over the vocabulary) and the swapped form were not measured so. XLA treats them differently,
though: between a float32-out product and the reshapes and transposes around it, the
convert keeps XLA's TPU layout assignment from folding them into the product, and the
float32 result is twice the size.

``rewrite_bf16_products`` rewrites every ``dot_general`` whose operands are both bf16,
whose result is float32 and whose one use is a ``convert`` to bf16 of the same shape:
the product becomes bf16-out and takes the convert's place. Of those, a product whose
left operand is a 2-D transpose and which has no batch dimensions (autograd's weight
gradient of a linear layer, ``g.t() @ x``) is written as torch_xla writes it,
``(x.t() @ g).t()``: ``transpose(dot_general(x, g))``, the same sums of the same products.
Alone, neither helps the 55M GPT's torch program on the v5e (libtpu's estimate: 33.27 ms
as written, 46.09 with bf16-out products alone, 33.31 with the swap alone); together the
attention kernels' gradients are relaid out 6 times instead of 24 (29.76; docs/tpu.md).
Anything else is left alone: a product with a second use of its float32 result, one
with operands of another type, and the bias form ``convert(add(dot_general(a, b) -> f32,
bias) -> f32) -> bf16`` (an ``nn.Linear``'s): PyTorch adds the bias in float32 and rounds
once; a bf16-out product followed by a bf16 add rounds twice.

On a CPU the two forms do not give the same bits (XLA:CPU rounds a bf16-out product
differently), so the runtime applies this on TPUs only, and on one device only
(``runtime/compile/rewrites.py``: over several, the partitioner sums a product's partial
sums after it, in bf16 for a bf16-out product).

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from .artifact import Module
from .build import i64s, verify
from .build import op as build_op
from .graph import element_type, producer, shape_of, uses_of

__all__ = ["count_bf16_products", "rewrite_bf16_products"]

hlo: Any = _stablehlo  # jaxlib's stubs do not cover the dialect's attribute classes


def _site(op: Any) -> Any:
    """The ``convert`` that rounds ``op``'s float32 product of two bf16 operands to bf16,
    when that is its one use; otherwise None."""
    if op.name != "stablehlo.dot_general" or len(op.results) != 1:
        return None
    if any(element_type(x) != "bf16" for x in op.operands) or element_type(op.result) != "f32":
        return None
    users = uses_of(op.result)
    if len(users) != 1 or users[0].name != "stablehlo.convert":
        return None
    convert = users[0]
    if element_type(convert.result) != "bf16" or shape_of(convert.result) != shape_of(op.result):
        return None
    return convert


def _sites(module: Module) -> list[tuple[Any, Any]]:
    with module._ctx:
        return [(op, convert) for op in module._operations() if (convert := _site(op)) is not None]


def _attributes(op: Any) -> dict[str, Any]:
    named = [op.attributes[i] for i in range(len(op.attributes))]
    return {a.name: a.attr for a in named}


def _transposed(value: Any) -> Any:
    """The operand of the 2-D transpose that writes ``value``, or None."""
    t = producer(value)
    if t is None or t.name != "stablehlo.transpose" or len(shape_of(value)) != 2:
        return None
    if list(ir.DenseI64ArrayAttr(t.attributes["permutation"])) != [1, 0]:
        return None
    return t.operands[0]


def _weight_gradient(dot: Any) -> bool:
    """``g.t() @ x``: two 2-D operands, no batch dimensions, one contracting dimension
    each, the left operand a transpose and the right one not."""
    dn = hlo.DotDimensionNumbers(dot.attributes["dot_dimension_numbers"])
    lhs, rhs = dot.operands
    return (
        not list(dn.lhs_batching_dimensions)
        and len(list(dn.lhs_contracting_dimensions)) == 1
        and len(list(dn.rhs_contracting_dimensions)) == 1
        and len(shape_of(lhs)) == len(shape_of(rhs)) == 2
        and _transposed(lhs) is not None
        and _transposed(rhs) is None
    )


_SHARDINGS = ("mhlo.sharding", "sdy.sharding")  # a result's split, which the swap transposes


def _bf16_out(dot: Any, convert: Any, swap: bool) -> Any:
    """The bf16-out product that replaces ``dot`` and ``convert`` (with ``swap``, the
    weight gradient written ``transpose(dot_general(x, g))``); returns the value that
    replaces the convert's."""
    attributes = _attributes(dot)
    out = ir.RankedTensorType(convert.result.type)
    with ir.InsertionPoint(dot), dot.location:
        if not swap:
            return build_op("stablehlo.dot_general", out, list(dot.operands), **attributes)
        for name in _SHARDINGS:  # none at this stage of a load; not carried transposed
            attributes.pop(name, None)
        dn = hlo.DotDimensionNumbers(dot.attributes["dot_dimension_numbers"])
        (lc,), (rc,) = list(dn.lhs_contracting_dimensions), list(dn.rhs_contracting_dimensions)
        lhs, x = dot.operands
        attributes["dot_dimension_numbers"] = hlo.DotDimensionNumbers.get(
            lhs_batching_dimensions=[],
            rhs_batching_dimensions=[],
            lhs_contracting_dimensions=[rc],
            rhs_contracting_dimensions=[1 - lc],
        )
        if "precision_config" in attributes:
            both = list(ir.ArrayAttr(attributes["precision_config"]))
            attributes["precision_config"] = ir.ArrayAttr.get(both[::-1])
        swapped = ir.RankedTensorType.get(out.shape[::-1], out.element_type)
        product = build_op("stablehlo.dot_general", swapped, [x, _transposed(lhs)], **attributes)
        return build_op("stablehlo.transpose", out, [product], permutation=i64s([1, 0]))


def count_bf16_products(module: Module) -> int:
    """How many products ``rewrite_bf16_products`` would rewrite in ``module``."""
    return len(_sites(module))


def rewrite_bf16_products(module: Module) -> tuple[int, int]:
    """Write each bf16 x bf16 product rounded to bf16 by its one use as a bf16-out
    product, in place (every function); returns how many, and how many of them were
    weight gradients written in torch_xla's operand order.

    Raises:
      ProgramError: the module does not verify afterwards.
    """
    sites = _sites(module)
    if not sites:
        return 0, 0
    with module._ctx:
        # classified before any is rewritten: a product reading a swapped one's result
        # (a transpose now) is not taken for a weight gradient
        swaps = [_weight_gradient(dot) for dot, _ in sites]
        unused = []
        for (dot, convert), swap in zip(sites, swaps, strict=True):
            source = producer(dot.operands[0]) if swap else None
            convert.result.replace_all_uses_with(_bf16_out(dot, convert, swap))
            convert.erase()
            dot.erase()
            if source is not None and not list(source.result.uses):
                unused.append(source)
        for transpose in unused:  # the g.t() only the old product read
            if not list(transpose.result.uses):
                transpose.erase()
        verify(module._module, "writing bf16 products bf16-out")
    return len(sites), sum(swaps)
