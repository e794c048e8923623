"""An experiment, not a runtime rewrite: bf16 products written float32-out and then
rounded, as bf16-out products.

The torch front-end writes a bf16 x bf16 matrix product as PyTorch computes it on the
CPU: accumulated in float32 and rounded to bf16 once, which it spells
``convert(dot_general(a, b) -> f32) -> bf16``. torch_xla writes the same product
``dot_general(a, b) -> bf16``. On a TPU the two compute the same values (the matrix unit
accumulates bf16 products in float32 and rounds the sum once, on the way out), but XLA
treats them differently: between a float32-out product and the reshapes and transposes
around it, the convert keeps XLA's TPU layout assignment from folding them into the
product, and it writes float32 results twice the size. What that costs a step is
measured by ``benchmarks/device/torch_frontend_hlo.py`` (libtpu's estimate) and on the
chip by ``benchmarks/device/attention_table.py``; docs/tpu.md has both.

``rewrite_bf16_products`` rewrites every ``dot_general`` whose operands are both bf16,
whose result is float32 and whose one use is a ``convert`` to bf16 of the same shape:
the product becomes bf16-out and takes the convert's place. Anything else is left alone:
a product with a second use of its float32 result, one with operands of another type, and
the bias form ``convert(add(dot_general(a, b) -> f32, bias) -> f32) -> bf16`` (an
``nn.Linear``'s): PyTorch adds the bias in float32 and rounds once; a bf16-out product
followed by a bf16 add rounds twice, so that rewrite would change values (XLA fuses the
float32 add and the rounding into the product's output on a TPU as written).

On a CPU the two forms do not give the same bits (XLA:CPU rounds a bf16-out product
differently). The runtime ran this on TPUs from 7ec9420 until the chip measured it
(docs/tpu.md): on the 55M GPT's torch front-end bundle the step took longer with it than
without, in one run, and the first loss changed, so on the chip the two forms did not
compute the same values either. It is kept here for ``torch_frontend_hlo.py``'s variants
and ``attention_table.py``'s ``bf16-products`` experiment.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir

from stepbundle.stablehlo.artifact import Module
from stepbundle.stablehlo.build import verify
from stepbundle.stablehlo.graph import element_type, shape_of, uses_of

__all__ = ["count_bf16_products", "rewrite_bf16_products"]


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


def count_bf16_products(module: Module) -> int:
    """How many products ``rewrite_bf16_products`` would rewrite in ``module``."""
    return len(_sites(module))


def rewrite_bf16_products(module: Module) -> int:
    """Write each bf16 x bf16 product rounded to bf16 by its one use as a bf16-out
    product, in place (every function). Returns the number rewritten.

    Raises:
      ValueError: the module does not verify afterwards.
    """
    sites = _sites(module)
    if not sites:
        return 0
    with module._ctx:
        for dot, convert in sites:
            with ir.InsertionPoint(dot):
                product = ir.Operation.create(
                    "stablehlo.dot_general",
                    results=[convert.result.type],
                    operands=list(dot.operands),
                    attributes=_attributes(dot),
                    loc=dot.location,
                )
            convert.result.replace_all_uses_with(product.result)
            convert.erase()
            dot.erase()
        verify(module._module, "writing bf16 products bf16-out")
    return len(sites)
