"""Optimization barriers around an output head's products, where XLA would fuse a
transformer's residual stream into them (the runtime's ``head-barriers`` rewrite; where it
applies is decided at load: ``runtime/compile/head_choice.py``).

Hugging Face GPT-2 through the torch_xla front-end on the v5e (run 19 of
``results/device/tpu-v5e/attention_table.json``, profiled): one fusion took 15.1 ms of the
84.3 ms step, against 3.6 ms for its counterpart in the hand-written JAX peer and 4.8 ms
in the torch front-end's program. It is the head's input-gradient product ``dlogits
(8192 x 50257) @ wte (50257 x 768)`` with the logits' gradient computed inside it, and
the final LayerNorm's backward and the whole residual stream (24 additions of the layers'
outputs, recomputed rather than kept from the forward) fused after it: 17 results, 12 of
them f32[8, 1024, 768].

A head product is a ``dot_general`` one of whose values (an operand or the result) has a
vocabulary-sized dimension: a size of at least ``MIN_VOCABULARY`` that ``@main``'s
embedding is looked up along (a floating-point argument a gather takes rows of), so that a
token count or a wide MLP as large is not taken for one. ``MODES`` says where each
mode puts the barriers; the runtime's is ``hidden``: on the values that are not
vocabulary-sized (the activations a head product reads, the input gradient it writes),
which keeps the stream out of the head and leaves the logits and their gradient fusable.
On the chip (runs 21-23): GPT-2 through torch_xla 84.31 -> 70.15 ms a step with
``hidden`` (75.44 with ``operands``); where XLA does not fuse the stream into the head,
``hidden`` moved the 123M Llama 47.79 -> 48.40 and GPT-2 through the torch front-end
72.90 -> 72.06 (``operands``: 54.36 and 80.24), which is why the load decides.

A barrier is the identity on values: on the CPU the program computes the same bits
(``tests/runtime/test_head_barrier.py``, ``tests/frontend_torch/test_head_barriers.py``);
on a TPU XLA fuses otherwise, which can move the last bits. The other modes are
``attention_table.py``'s and ``torch_frontend_hlo.py``'s experiments.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.
"""

from __future__ import annotations

import math
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from stepbundle.schema.errors import UsageError
from stepbundle.stablehlo.artifact import Module
from stepbundle.stablehlo.build import op as build_op
from stepbundle.stablehlo.build import verify
from stepbundle.stablehlo.graph import function_type
from stepbundle.stablehlo.lookups import lookup_dims

__all__ = [
    "MIN_VOCABULARY",
    "MODES",
    "count_head_barriers",
    "head_barrier_text",
    "head_vocabularies",
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
_FLOATS = ("f64", "f32", "f16", "bf16")
hlo: Any = _stablehlo  # jaxlib's stubs do not cover the dialect's attribute classes


def _vocabularies(module: Module) -> frozenset[int]:
    """The sizes that are a vocabulary here: the sizes of at least ``MIN_VOCABULARY`` of
    the dimensions that ``@main``'s floating-point tables are looked rows up in (an
    embedding's gather, ``lookups.lookup_dims``). A token count, or an MLP's width of
    16,384, which can be as large, is no looked-up dimension."""
    sizes: set[int] = set()
    inputs = function_type(module, "main").inputs
    for i, dims in lookup_dims(module).items():
        t = ir.RankedTensorType(inputs[i])  # a gather's operand: a ranked tensor
        if str(t.element_type) in _FLOATS:
            sizes.update(t.shape[d] for d in dims if t.shape[d] >= MIN_VOCABULARY)
    return frozenset(sizes)


def _vocab_sized(value: Any, vocab: frozenset[int]) -> bool:
    return any(d in vocab for d in ir.RankedTensorType(value.type).shape)


def _contracted(op: Any) -> int:
    dn = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    lhs = ir.RankedTensorType(op.operands[0].type)
    return math.prod(lhs.shape[d] for d in dn.lhs_contracting_dimensions)


def _is_logits(op: Any, vocab: frozenset[int]) -> bool:
    """A product writing vocabulary-sized logits: it sums over fewer elements than the
    smallest dimension of its result (the width; a weight gradient sums over the tokens)."""
    out = ir.RankedTensorType(op.result.type)
    return _vocab_sized(op.result, vocab) and _contracted(op) < min(out.shape)


def _held(op: Any, value: Any) -> bool:
    """Whether ``value`` (an operand or the result of ``op``) already passes a barrier."""
    if value == op.result:
        uses = [u.owner.name for u in value.uses]
        return bool(uses) and all(u == _BARRIER for u in uses)
    owner = value.owner
    return not isinstance(owner, ir.Block) and owner.name == _BARRIER


def _targets(op: Any, mode: str, vocab: frozenset[int]) -> list[Any]:
    """The values of the product ``op`` that ``mode`` puts behind barriers (none where it
    is not a head product or they are behind barriers already)."""
    if op.name != "stablehlo.dot_general":
        return []
    values = [*op.operands, op.result]
    if not any(_vocab_sized(v, vocab) for v in values):
        return []
    if mode in ("hidden", "hidden-backward"):
        if mode == "hidden-backward" and _is_logits(op, vocab):
            return []
        wanted = [v for v in values if not _vocab_sized(v, vocab)]
    elif mode == "operands":
        wanted = values
    else:  # "result": the input gradient alone
        lhs = ir.RankedTensorType(op.operands[0].type)
        out = ir.RankedTensorType(op.result.type)
        small = math.prod(out.shape) < math.prod(lhs.shape)
        wanted = [op.result] if _contracted(op) in vocab and small else []
    return [] if all(_held(op, v) for v in wanted) else wanted


def _after(op: Any) -> Any:
    """An insertion point just after ``op`` (older jaxlibs have no
    ``InsertionPoint.after``)."""
    if hasattr(ir.InsertionPoint, "after"):
        return ir.InsertionPoint.after(op)  # type: ignore[attr-defined]
    ops = list(op.operation.block.operations)
    at = next(i for i, o in enumerate(ops) if o.operation == op.operation)
    return ir.InsertionPoint(ops[at + 1])  # a product is never its block's terminator


def _insert(module: Module, mode: str) -> int:
    if mode not in MODES:
        raise UsageError(f"mode must be one of {', '.join(MODES)}, got {mode!r}.")
    vocab = _vocabularies(module)
    sites = [(op, t) for op in module._operations() if (t := _targets(op, mode, vocab))]
    for op, targets in sites:
        if any(v == op.result for v in targets):
            with _after(op), op.location:
                held = build_op(_BARRIER, op.result.type, [op.result])
            for use in list(op.result.uses):
                if use.owner != held.owner:
                    use.owner.operands[use.operand_number] = held
        with ir.InsertionPoint(op), op.location:
            for i, operand in enumerate(list(op.operands)):
                if any(v == operand for v in targets):
                    op.operands[i] = build_op(_BARRIER, operand.type, [operand])
    return len(sites)


def head_vocabularies(module: Module) -> frozenset[int]:
    """The vocabulary sizes of ``module`` (sizes of at least ``MIN_VOCABULARY`` its
    embedding is looked up along); empty for none."""
    with module._ctx:
        return _vocabularies(module)


def count_head_barriers(module: Module, mode: str = "hidden") -> int:
    """The products of ``module`` that ``rewrite_head_barriers`` would put barriers on."""
    with module._ctx:
        vocab = _vocabularies(module)
        return sum(1 for op in module._operations() if _targets(op, mode, vocab))


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
