"""A gather from a widened float value picks from the narrow value
(benchmarks/device/narrow_gathers.py, an experiment of attention_table.py), pinned on the
CPU so that the chip's A/B compares programs that compute the same thing: the gather the one-hot rewrite makes of a bf16 model's cross-entropy
is taken, what is not a widening is left alone, and the values are the same bits (against
numpy, which shares no code with either program)."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from runtime_helpers import golden_train_module, run_on_cpu

from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.onehot import rewrite_onehot_reductions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "device"))
from narrow_gathers import count_narrow_gathers, rewrite_narrow_gathers  # noqa: E402

# bf16 logits widened to float32 and reshaped, as torch_xla writes cross_entropy's input
# under autocast, then the per-token logit at the target through a one-hot sum (which
# onehot-sums turns into a gather from the float32 logits).
WIDENED_PICK = """
func.func @main(%x: tensor<6x10xbf16>, %t: tensor<2x3xi32>) -> (tensor<2x3xf32>, tensor<6xf32>) {
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32>
  %xw = stablehlo.convert %x : (tensor<6x10xbf16>) -> tensor<6x10xf32>
  %x3 = stablehlo.reshape %xw : (tensor<6x10xf32>) -> tensor<2x3x10xf32>
  %t1 = stablehlo.broadcast_in_dim %t, dims = [0, 1] : (tensor<2x3xi32>) -> tensor<2x3x1xi32>
  %tb = stablehlo.broadcast_in_dim %t1, dims = [0, 1, 2] : (tensor<2x3x1xi32>) -> tensor<2x3x10xi32>
  %io = stablehlo.iota dim = 0 : tensor<10xi32>
  %i1 = stablehlo.broadcast_in_dim %io, dims = [2] : (tensor<10xi32>) -> tensor<1x1x10xi32>
  %ib = stablehlo.broadcast_in_dim %i1, dims = [0, 1, 2] : (tensor<1x1x10xi32>) -> tensor<2x3x10xi32>
  %hot = stablehlo.compare EQ, %tb, %ib, SIGNED : (tensor<2x3x10xi32>, tensor<2x3x10xi32>) -> tensor<2x3x10xi1>
  %oh = stablehlo.convert %hot : (tensor<2x3x10xi1>) -> tensor<2x3x10xf32>
  %p = stablehlo.multiply %oh, %x3 : tensor<2x3x10xf32>
  %r = stablehlo.reduce(%p init: %z) applies stablehlo.add across dimensions = [2] : (tensor<2x3x10xf32>, tensor<f32>) -> tensor<2x3xf32>
  %m = stablehlo.reduce(%xw init: %ninf) applies stablehlo.maximum across dimensions = [1] : (tensor<6x10xf32>, tensor<f32>) -> tensor<6xf32>
  return %r, %m : tensor<2x3xf32>, tensor<6xf32>
}
"""


def _module(text: str) -> mlir.Module:
    return mlir.Module.parse_text(golden_train_module("linear_adamw"), text)


def _gather_operand_types(module: mlir.Module) -> list[str]:
    """The element type each used gather reads from."""
    found = []
    for op in module._operations():
        if op.name == "stablehlo.gather" and any(True for _ in op.results[0].uses):
            found.append(str(op.operands[0].type).rsplit("x", 1)[-1].rstrip(">"))
    return found


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 10)) * 4).astype(ml_dtypes.bfloat16)
    t = np.array([[3, 0, 9], [10, -1, 4]], dtype=np.int32)  # two outside the classes
    return x, t


def test_the_one_hot_pick_from_widened_logits_gathers_the_bf16_logits() -> None:
    module = _module(WIDENED_PICK)
    assert rewrite_onehot_reductions(module) == 1
    assert _gather_operand_types(module) == ["f32"]  # the float32 logits, whole
    assert count_narrow_gathers(module) == 1
    assert rewrite_narrow_gathers(module) == 1
    assert _gather_operand_types(module) == ["bf16"]
    assert count_narrow_gathers(module) == 0


def test_the_values_are_the_same_bits() -> None:
    x, t = _inputs()
    picked = _module(WIDENED_PICK)
    rewrite_onehot_reductions(picked)
    before = run_on_cpu(picked, x, t)
    rewrite_narrow_gathers(picked)
    after = run_on_cpu(picked, x, t)
    for a, b in zip(before, after):
        assert a.dtype == b.dtype == np.float32
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    # numpy: the bf16 logit at each target that is a class, widened; 0 for the others.
    xs = x.astype(np.float64).reshape(2, 3, 10)
    inside = (t >= 0) & (t < 10)
    want = np.where(inside, np.take_along_axis(xs, np.clip(t, 0, 9)[..., None], 2)[..., 0], 0)
    np.testing.assert_array_equal(after[0], want)
    np.testing.assert_array_equal(after[1], x.astype(np.float64).max(1))


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        # float64 to float32 rounds: picking first would pick unrounded values
        ("tensor<6x10xbf16>", "tensor<6x10xf64>", "a narrowing conversion"),
        # an integer widened to a float is not a float widening
        ("tensor<6x10xbf16>", "tensor<6x10xi32>", "an integer source"),
    ],
)
def test_other_conversions_are_left_alone(old: str, new: str, why: str) -> None:
    module = _module(WIDENED_PICK.replace(old, new))
    rewrite_onehot_reductions(module)
    assert _gather_operand_types(module) == ["f32"], why
    assert count_narrow_gathers(module) == 0, why
    assert rewrite_narrow_gathers(module) == 0, why
