"""Optimization barriers around an output head's products (benchmarks/device/head_barrier.py,
an experiment of attention_table.py), pinned on the CPU so that the chip's A/B compares
programs that compute the same thing: which products get barriers in each mode, that a
second pass adds none, and that the values are the same bits (and numpy's, which shares no
code with either program)."""

from __future__ import annotations

from typing import Any

import numpy as np
from jaxlib.mlir import ir
from runtime_helpers import golden_train_module, run_on_cpu

from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.head_barriers import MODES, count_head_barriers, rewrite_head_barriers

# A head over a vocabulary of 16384 (the size %w is looked rows up along, at %ids: an
# embedding): the logits h @ w^T, and the input gradient g @ w that sums over the
# vocabulary; plus a small product that has nothing vocabulary-sized.
HEAD = """
func.func @main(%h: tensor<8x4xf32>, %w: tensor<16384x4xf32>, %g: tensor<8x16384xf32>, %s: tensor<4x4xf32>, %ids: tensor<8x1xi32>)
    -> (tensor<8x16384xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>) {
  %e = "stablehlo.gather"(%w, %ids) {dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1, 4>} : (tensor<16384x4xf32>, tensor<8x1xi32>) -> tensor<8x4xf32>
  %logits = stablehlo.dot_general %h, %w, contracting_dims = [1] x [1] : (tensor<8x4xf32>, tensor<16384x4xf32>) -> tensor<8x16384xf32>
  %dh = stablehlo.dot_general %g, %w, contracting_dims = [1] x [0] : (tensor<8x16384xf32>, tensor<16384x4xf32>) -> tensor<8x4xf32>
  %dh2 = stablehlo.add %dh, %h : tensor<8x4xf32>
  %small = stablehlo.dot_general %h, %s, contracting_dims = [1] x [0] : (tensor<8x4xf32>, tensor<4x4xf32>) -> tensor<8x4xf32>
  return %logits, %dh2, %small, %e : tensor<8x16384xf32>, tensor<8x4xf32>, tensor<8x4xf32>, tensor<8x4xf32>
}
"""


# 20,000 tokens in a layer's weight gradient, and an MLP 16,384 wide: as large as a
# vocabulary, and neither is one (no table is looked up along them), so no mode puts a
# barrier here; the embedding's vocabulary of 1,000 is too small to be a head's.
TOKENS = """
func.func @main(%x: tensor<2x10000x4xf32>, %dy: tensor<2x10000x8xf32>, %w: tensor<4x8xf32>, %wide: tensor<4x16384xf32>, %emb: tensor<1000x4xf32>, %ids: tensor<8x1xi32>)
    -> (tensor<4x8xf32>, tensor<20000x16384xf32>, tensor<8x4xf32>) {
  %a = stablehlo.reshape %x : (tensor<2x10000x4xf32>) -> tensor<20000x4xf32>
  %b = stablehlo.reshape %dy : (tensor<2x10000x8xf32>) -> tensor<20000x8xf32>
  %dw = stablehlo.dot_general %a, %b, contracting_dims = [0] x [0] : (tensor<20000x4xf32>, tensor<20000x8xf32>) -> tensor<4x8xf32>
  %w2 = stablehlo.add %w, %dw : tensor<4x8xf32>
  %up = stablehlo.dot_general %a, %wide, contracting_dims = [1] x [0] : (tensor<20000x4xf32>, tensor<4x16384xf32>) -> tensor<20000x16384xf32>
  %e = "stablehlo.gather"(%emb, %ids) {dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, slice_sizes = array<i64: 1, 4>} : (tensor<1000x4xf32>, tensor<8x1xi32>) -> tensor<8x4xf32>
  return %w2, %up, %e : tensor<4x8xf32>, tensor<20000x16384xf32>, tensor<8x4xf32>
}
"""


def test_a_token_count_is_not_a_vocabulary() -> None:
    module = mlir.Module.parse_text(golden_train_module("linear_adamw"), TOKENS)
    for mode in MODES:
        assert count_head_barriers(module, mode=mode) == 0
        assert rewrite_head_barriers(module, mode=mode) == 0
    assert _barriers(module) == 0


def _module() -> mlir.Module:
    return mlir.Module.parse_text(golden_train_module("linear_adamw"), HEAD)


def _barriers(module: mlir.Module) -> int:
    return sum(1 for op in module._operations() if op.name == "stablehlo.optimization_barrier")


def _defined_by(value: Any) -> str:
    owner = value.owner
    return "argument" if isinstance(owner, ir.Block) else owner.operation.name


def _reads(module: mlir.Module, name: str) -> list[list[str]]:
    """For each ``name`` operation, what defines each of its operands, in order."""
    with module._ctx:
        (func,) = module._module.body.operations
        body = func.regions[0].blocks[0].operations  # in program order
        return [[_defined_by(v) for v in op.operands] for op in body if op.name == name]


BARRIER, DOT = "stablehlo.optimization_barrier", "stablehlo.dot_general"
GATHER = "stablehlo.gather"


def test_the_input_gradient_alone_or_every_head_product_with_its_operands() -> None:
    module = _module()
    assert count_head_barriers(module, mode="result") == 1  # %dh: it sums over 16384
    assert rewrite_head_barriers(module, mode="result") == 1
    assert _barriers(module) == 1
    # %dh2 reads %dh through the barrier; the outputs are the products' own otherwise
    assert _reads(module, "stablehlo.add") == [[BARRIER, "argument"]]
    assert _reads(module, "func.return") == [[DOT, "stablehlo.add", DOT, GATHER]]
    assert _reads(module, BARRIER) == [[DOT]]
    assert rewrite_head_barriers(module, mode="result") == 0  # a second pass adds nothing

    module = _module()
    assert count_head_barriers(module, mode="operands") == 2  # %logits and %dh, not %small
    assert rewrite_head_barriers(module, mode="operands") == 2
    assert _barriers(module) == 2 * 3  # each product's two operands and its result
    # the two head products read barriers; the small one reads the arguments
    assert _reads(module, DOT) == [[BARRIER, BARRIER], [BARRIER, BARRIER], ["argument"] * 2]
    assert _reads(module, "func.return") == [[BARRIER, "stablehlo.add", DOT, GATHER]]
    assert _reads(module, "stablehlo.add") == [[BARRIER, "argument"]]
    assert rewrite_head_barriers(module, mode="operands") == 0

    module = _module()  # the values that are not vocabulary-sized: %h read, %dh written
    assert count_head_barriers(module, mode="hidden") == 2
    assert rewrite_head_barriers(module, mode="hidden") == 2
    assert _barriers(module) == 2  # %h before %logits, %dh after it; %g and %w are not held
    assert _reads(module, DOT) == [[BARRIER, "argument"], ["argument"] * 2, ["argument"] * 2]
    assert _reads(module, "stablehlo.add") == [[BARRIER, "argument"]]
    assert _reads(module, "func.return") == [[DOT, "stablehlo.add", DOT, GATHER]]
    assert rewrite_head_barriers(module, mode="hidden") == 0


def test_the_values_are_the_same_bits() -> None:
    rng = np.random.default_rng(5)
    h = rng.standard_normal((8, 4)).astype(np.float32)
    w = rng.standard_normal((16384, 4)).astype(np.float32)
    g = rng.standard_normal((8, 16384)).astype(np.float32)
    s = rng.standard_normal((4, 4)).astype(np.float32)
    ids = rng.integers(0, 16384, (8, 1)).astype(np.int32)
    before = run_on_cpu(_module(), h, w, g, s, ids)
    for mode in MODES:
        module = _module()
        rewrite_head_barriers(module, mode=mode)
        after = run_on_cpu(module, h, w, g, s, ids)
        for a, b in zip(before, after):
            assert a.dtype == b.dtype == np.float32 and len(after) == 4
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    h64, w64, g64 = h.astype(np.float64), w.astype(np.float64), g.astype(np.float64)
    np.testing.assert_allclose(before[0], h64 @ w64.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(before[1], g64 @ w64 + h64, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(before[2], h64 @ s.astype(np.float64), rtol=1e-5, atol=1e-5)
    assert np.array_equal(before[3], w[ids[:, 0]])


def test_an_unknown_mode_is_a_usage_error() -> None:
    import pytest

    from stepbundle.schema.errors import UsageError

    with pytest.raises(
        UsageError,
        match="mode must be one of hidden, hidden-backward, result, operands, got 'bogus'",
    ):
        rewrite_head_barriers(_module(), mode="bogus")
