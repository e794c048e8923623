"""An experiment, not a runtime rewrite: the output head's input gradient read through an
optimization barrier.

Hugging Face GPT-2 through the torch_xla front-end on the v5e (run 19 of
``results/device/tpu-v5e/attention_table.json``, profiled): one fusion took 15.1 ms of the
84.3 ms step, against 3.6 ms for its counterpart in the hand-written JAX peer and 4.8 ms
in the torch front-end's program. Compiled offline (libtpu 0.0.42.1), it is the head's
input-gradient product ``dlogits (8192 x 50257) @ wte (50257 x 768)`` with the logits'
gradient computed inside it from the bf16 logits and the targets, and with the final
LayerNorm's backward and the whole residual stream (24 additions of the layers' outputs,
recomputed rather than kept from the forward) fused after it: 17 results, 12 of them
f32[8, 1024, 768]; libtpu's cost model prices it at 38.2M cycles.

``rewrite_head_barriers`` puts a ``stablehlo.optimization_barrier`` on the result of each
product that contracts over at least ``MIN_CONTRACTED`` elements (a vocabulary) into a
result smaller than its contracted operand: XLA can then fuse nothing that reads the
product's result into the product; ``operands=True`` (``head-barrier-operands``) also puts
each operand of every product with a vocabulary-sized dimension behind one, so XLA fuses
nothing into them either. A barrier is the identity on values: on the CPU the program
computes the same bits (``tests/runtime/test_head_barrier.py``); on a TPU XLA fuses
otherwise, which can move the last bits. ``attention_table.py``'s ``head-barrier`` and
``head-barrier-operands`` experiments insert them after the runtime's ``fused-attention``
rewrite; ``torch_frontend_hlo.py compile --variant`` inserts them into the bundle's text,
before the runtime's rewrites: the two pipelines are not quite the same, though the
one-hot sums' rewrite finds as many sums either way (3, 2 and 3 in the three bundles
below, checked on their programs). Measured on the chip (run 21 of ``attention_table.json``): GPT-2 through
torch_xla 84.33 -> 75.44 ms a step, GPT-2 through the torch front-end 72.90 -> 80.24, the
123M Llama through torch_xla 47.81 -> 54.36; compiled offline, ``torch_frontend_hlo.py
compare --out benchmarks/results/head_barrier-v5e.json`` priced each program
(``results/head_barrier-v5e.json``).

The size test is a size, not a vocabulary: a step of at least ``MIN_CONTRACTED`` tokens
(GPT-2 at batch 16) would also put barriers on every weight gradient (which sums over the
tokens), and with ``operands`` on every layer's products.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.
"""

from __future__ import annotations

import math
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from stepbundle.stablehlo.artifact import Module
from stepbundle.stablehlo.build import verify

__all__ = [
    "MIN_VOCABULARY",
    "MODES",
    "count_head_barriers",
    "head_barrier_text",
    "rewrite_head_barriers",
]

MIN_VOCABULARY = 16384
"""The least size of a dimension that makes a product a head's: a vocabulary."""

MODES = ("hidden", "hidden-backward", "result", "operands")
"""Where the barriers go, around each head product (a product with a vocabulary-sized
dimension in an operand or its result):

- ``hidden``: on its values that are not vocabulary-sized, the activations it reads and the
  input gradient it writes (the runtime's: ``head_choice.py``);
- ``hidden-backward``: the same, but for the logits' product (the forward);
- ``result``: on the result of each product summing over a vocabulary into a result
  smaller than its operand (the input gradient), nothing else;
- ``operands``: on both operands and the result of every head product."""

_BARRIER = "stablehlo.optimization_barrier"
hlo: Any = _stablehlo  # jaxlib's stubs do not cover the dialect's attribute classes


def _vocab_sized(value: Any) -> bool:
    return max(ir.RankedTensorType(value.type).shape, default=0) >= MIN_VOCABULARY


def _contracted(op: Any) -> int:
    dn = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    lhs = ir.RankedTensorType(op.operands[0].type)
    return math.prod(lhs.shape[d] for d in dn.lhs_contracting_dimensions)


def _is_logits(op: Any) -> bool:
    """A product writing vocabulary-sized logits: it sums over fewer elements than the
    smallest dimension of its result (the width; a weight gradient sums over the tokens)."""
    out = ir.RankedTensorType(op.result.type)
    return _vocab_sized(op.result) and _contracted(op) < min(out.shape)


def _held(op: Any, value: Any) -> bool:
    """Whether ``value`` (an operand or the result of ``op``) already passes a barrier."""
    if value == op.result:
        uses = [u.owner.name for u in value.uses]
        return bool(uses) and all(u == _BARRIER for u in uses)
    owner = value.owner
    return not isinstance(owner, ir.Block) and owner.name == _BARRIER


def _targets(op: Any, mode: str) -> list[Any]:
    """The values of the product ``op`` that ``mode`` puts behind barriers (none where it
    is not a head product or they are behind barriers already)."""
    if op.name != "stablehlo.dot_general":
        return []
    values = [*op.operands, op.result]
    if not any(_vocab_sized(v) for v in values):
        return []
    if mode in ("hidden", "hidden-backward"):
        if mode == "hidden-backward" and _is_logits(op):
            return []
        wanted = [v for v in values if not _vocab_sized(v)]
    elif mode == "operands":
        wanted = values
    else:  # "result": the input gradient alone
        lhs = ir.RankedTensorType(op.operands[0].type)
        out = ir.RankedTensorType(op.result.type)
        small = math.prod(out.shape) < math.prod(lhs.shape)
        wanted = [op.result] if _contracted(op) >= MIN_VOCABULARY and small else []
    return [] if all(_held(op, v) for v in wanted) else wanted


def _after(op: Any) -> Any:
    """An insertion point just after ``op`` (older jaxlibs have no
    ``InsertionPoint.after``)."""
    if hasattr(ir.InsertionPoint, "after"):
        return ir.InsertionPoint.after(op)  # type: ignore[attr-defined]
    ops = list(op.operation.block.operations)
    at = next(i for i, o in enumerate(ops) if o.operation == op.operation)
    return ir.InsertionPoint(ops[at + 1])  # a product is never its block's terminator


def _hold(value: Any) -> Any:
    return ir.Operation.create(_BARRIER, results=[value.type], operands=[value])


def _insert(module: Module, mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    sites = [(op, t) for op in module._operations() if (t := _targets(op, mode))]
    for op, targets in sites:
        if any(v == op.result for v in targets):
            with _after(op), op.location:
                barrier = _hold(op.result)
            for use in list(op.result.uses):
                if use.owner != barrier:
                    use.owner.operands[use.operand_number] = barrier.result
        with ir.InsertionPoint(op), op.location:
            for i, operand in enumerate(list(op.operands)):
                if any(v == operand for v in targets):
                    op.operands[i] = _hold(operand).result
    return len(sites)


def count_head_barriers(module: Module, mode: str = "hidden") -> int:
    """The products of ``module`` that ``rewrite_head_barriers`` would put barriers on."""
    with module._ctx:
        return sum(1 for op in module._operations() if _targets(op, mode))


def rewrite_head_barriers(module: Module, mode: str = "hidden") -> int:
    """Put the barriers in, in place; the number of products."""
    with module._ctx:
        done = _insert(module, mode)
        if done:
            verify(module._module, "optimization barriers around the output head's products")
    return done


def head_barrier_text(text: str, mode: str = "hidden") -> tuple[str, int]:
    """The same on a module's text (``torch_frontend_hlo.py``'s variants); the caller holds
    an MLIR context with the StableHLO dialect loaded."""
    module = Module(ir.Context.current, ir.Module.parse(text))
    done = _insert(module, mode)
    assert module._module.operation.verify()
    return str(module._module), done
