"""An experiment, not a runtime rewrite: a gather from a widened float value picks from
the narrow value and widens what it picked.

Hugging Face GPT-2 through the torch_xla front-end under bf16 autocast: the logits come
out of the output head in bf16 and are converted to float32 for cross-entropy, and the
runtime's ``onehot-sums`` rewrite turns torch_xla's one-hot sum into a
``stablehlo.gather`` of the target's logit from those float32 logits. Compiled offline for
a v5e, XLA then writes the whole float32 logits to memory once more, transposed, to pick
one element a row: a ``copy`` of ``f32[8, 1024, 50257]`` (1.57 GB) that the torch
front-end's program does not have (``benchmarks/results/frontend_gap-v5e.md``).

``rewrite_narrow_gathers`` turns ``gather(reshape*(convert(x)))`` into
``convert(gather(reshape*(x)))`` where the conversion widens one float type to another
(bf16 or f16 to float32 or float64, float32 to float64). A widening conversion is exact
and a gather only selects elements, so every value is the same, bit for bit
(``tests/runtime/test_narrow_gathers.py``). Compiled offline, the copy goes, but XLA's
layout assignment then writes the bf16 logits' gradient twice, in two layouts, and
libtpu's estimate of the step grows; only the chip can say which is faster, and this
session had no device time left. ``attention_table.py``'s ``narrow-gathers`` experiment
runs it.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir

from stepbundle.stablehlo.artifact import Module
from stepbundle.stablehlo.build import op as _op
from stepbundle.stablehlo.build import verify

__all__ = ["WIDENING", "count_narrow_gathers", "rewrite_narrow_gathers"]

WIDENING = frozenset(
    {("bf16", "f32"), ("f16", "f32"), ("bf16", "f64"), ("f16", "f64"), ("f32", "f64")}
)
"""Float conversions that are exact (narrow type, wide type), as MLIR spells the types."""


def _element(value: Any) -> str:
    return str(ir.RankedTensorType(value.type).element_type)


def _narrow_source(gather: Any) -> tuple[Any, list[Any]] | None:
    """The narrow value ``x`` and the reshapes (outermost first) of a gather of
    ``reshape*(convert(x))`` whose conversion widens; None for any other gather."""
    reshapes: list[Any] = []
    value = gather.operands[0]
    while True:
        owner = value.owner
        if isinstance(owner, ir.Block):
            return None  # a block argument
        owner = owner.operation
        if owner.name == "stablehlo.reshape":
            reshapes.append(owner)
            value = owner.operands[0]
            continue
        if owner.name != "stablehlo.convert":
            return None
        source = owner.operands[0]
        if (_element(source), _element(value)) not in WIDENING:
            return None
        return source, reshapes


def count_narrow_gathers(module: Module) -> int:
    """The gathers of ``module`` that ``rewrite_narrow_gathers`` would rewrite."""
    with module._ctx:
        return sum(
            1
            for op in module._operations()
            if op.name == "stablehlo.gather" and _narrow_source(op) is not None
        )


def rewrite_narrow_gathers(module: Module) -> int:
    """Gather before widening, in place (see the module docstring). Returns the number of
    gathers rewritten.

    Raises:
      ValueError: the module does not verify after the rewrite (it may then be partly
        rewritten: ``runtime/compile/rewrites.py`` rewrites a copy).
    """
    done = 0
    with module._ctx:
        for gather in module._operations():
            if gather.name != "stablehlo.gather":
                continue
            found = _narrow_source(gather)
            if found is None:
                continue
            value, reshapes = found
            narrow = ir.RankedTensorType(value.type).element_type
            wide_result = gather.results[0].type
            with ir.InsertionPoint(gather), gather.location:
                for reshape in reversed(reshapes):  # the one next to the conversion first
                    shape = ir.RankedTensorType(reshape.results[0].type).shape
                    value = _op(
                        "stablehlo.reshape", ir.RankedTensorType.get(shape, narrow), [value]
                    )
                shape = ir.RankedTensorType(wide_result).shape
                picked = ir.Operation.create(
                    "stablehlo.gather",
                    results=[ir.RankedTensorType.get(shape, narrow)],
                    operands=[value, *list(gather.operands)[1:]],
                    attributes={name: gather.attributes[name] for name in gather.attributes},
                ).result
                widened = _op("stablehlo.convert", wide_result, [picked])
            gather.results[0].replace_all_uses_with(widened)
            gather.erase()
            done += 1
        if done:
            verify(module._module, "gathering before widening")
    return done
