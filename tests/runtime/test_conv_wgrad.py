"""Weight-gradient convolutions as matrix products (stablehlo/conv_wgrad.py), pinned on
the CPU: which convolutions the rewrite takes (the StableHLO form that took a TPU's
compiler 60 s), and that the rewritten program computes the convolution (against numpy
in float64, which shares no code with either)."""

from __future__ import annotations

import numpy as np
from runtime_helpers import golden_train_module, run_on_cpu

from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.conv_wgrad import rewrite_weight_gradients

# The three convolutions of one torch_xla conv layer's training step, as torch_xla 2.9
# writes them (examples/cifar_cnn.py's first block): forward, input gradient (of a
# second layer) and weight gradient, with a map-sized window.
CONVS = """
func.func @main(%x: tensor<4x3x8x8xf32>, %w: tensor<5x3x3x3xf32>, %dy: tensor<4x5x8x8xf32>, %w2: tensor<3x3x3x5xf32>) -> (tensor<4x5x8x8xf32>, tensor<4x3x8x8xf32>, tensor<3x3x3x5xf32>) {
  %y = stablehlo.convolution(%x, %w) dim_numbers = [b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1], window = {pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<4x3x8x8xf32>, tensor<5x3x3x3xf32>) -> tensor<4x5x8x8xf32>
  %dx = stablehlo.convolution(%dy, %w2) dim_numbers = [b, f, 0, 1]x[0, 1, o, i]->[b, f, 0, 1], window = {pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<4x5x8x8xf32>, tensor<3x3x3x5xf32>) -> tensor<4x3x8x8xf32>
  %dw = stablehlo.convolution(%x, %dy) dim_numbers = [f, b, 0, 1]x[i, o, 0, 1]->[0, 1, b, f], window = {pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<4x3x8x8xf32>, tensor<4x5x8x8xf32>) -> tensor<3x3x3x5xf32>
  return %y, %dx, %dw : tensor<4x5x8x8xf32>, tensor<4x3x8x8xf32>, tensor<3x3x3x5xf32>
}
"""


def _like() -> mlir.Module:
    return golden_train_module("linear_adamw")


def _ops(module: mlir.Module, name: str) -> int:
    return sum(op.name == name for op in module._operations())


def _run(module: mlir.Module, args: list[np.ndarray]) -> list[np.ndarray]:
    return run_on_cpu(module, *args)


def test_only_the_weight_gradient_is_rewritten() -> None:
    module = mlir.Module.parse_text(_like(), CONVS)
    assert rewrite_weight_gradients(module) == 1
    assert _ops(module, "stablehlo.convolution") == 2  # forward and input gradient stay
    assert _ops(module, "stablehlo.dot_general") == 9  # one per 3x3 output position
    assert rewrite_weight_gradients(module) == 0


def test_the_rewritten_weight_gradient_is_the_convolution() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((4, 5, 8, 8)).astype(np.float32)
    w2 = rng.standard_normal((3, 3, 3, 5)).astype(np.float32)
    # numpy, float64: dw[kh, kw, c, o] = sum_{n, h, w} xpad[n, c, h + kh, w + kw] dy[n, o, h, w]
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.zeros((3, 3, 3, 5))
    for kh in range(3):
        for kw in range(3):
            ref[kh, kw] = np.einsum("nchw,nohw->co", xp[:, :, kh : kh + 8, kw : kw + 8], dy)
    args = [x, w, dy, w2]
    before = _run(mlir.Module.parse_text(_like(), CONVS), args)
    rewritten = mlir.Module.parse_text(_like(), CONVS)
    rewrite_weight_gradients(rewritten)
    after = _run(rewritten, args)
    scale = np.max(np.abs(ref))
    assert np.max(np.abs(before[2] - ref)) / scale < 1e-6  # XLA's convolution
    assert np.max(np.abs(after[2] - ref)) / scale < 1e-6  # the matrix products
    for a, b in zip(before[:2], after[:2]):  # the other convolutions are untouched
        assert np.array_equal(a, b)


def test_a_strided_weight_gradient_is_left_alone() -> None:
    # A strided layer's weight gradient has window strides (or dilations): not the form
    # measured, and not the product the rewrite writes.
    text = CONVS.replace(
        "->[0, 1, b, f], window = {pad", "->[0, 1, b, f], window = {stride = [2, 2], pad"
    ).replace(
        "tensor<4x5x8x8xf32>) -> tensor<3x3x3x5xf32>", "tensor<4x5x8x8xf32>) -> tensor<2x2x3x5xf32>"
    )
    text = text.replace(
        "%dw : tensor<4x5x8x8xf32>, tensor<4x3x8x8xf32>, tensor<3x3x3x5xf32>",
        "%dw : tensor<4x5x8x8xf32>, tensor<4x3x8x8xf32>, tensor<2x2x3x5xf32>",
    )
    text = text.replace(
        "-> (tensor<4x5x8x8xf32>, tensor<4x3x8x8xf32>, tensor<3x3x3x5xf32>)",
        "-> (tensor<4x5x8x8xf32>, tensor<4x3x8x8xf32>, tensor<2x2x3x5xf32>)",
    )
    module = mlir.Module.parse_text(_like(), text)
    assert rewrite_weight_gradients(module) == 0
    assert _ops(module, "stablehlo.convolution") == 3


def test_attributes_are_read_in_both_spellings() -> None:
    """Padding comes as dense elements (splat or not), strides as arrays; all read flat."""
    from jaxlib.mlir import ir

    from stepbundle.stablehlo.conv_wgrad import _flat

    with ir.Context():
        read = [
            _flat(ir.Attribute.parse(text))
            for text in (
                "dense<1> : tensor<2x2xi64>",
                "dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>",
                "array<i64: 2, 3>",
                "array<i1: true, false>",
            )
        ]
    assert read == [[1, 1, 1, 1], [0, 1, 2, 3], [2, 3], [True, False]]


def test_the_stacked_form_computes_the_same() -> None:
    # The windows stacked into one product (kept for compile_variants.py's comparison).
    rng = np.random.default_rng(1)
    shapes = ((4, 3, 8, 8), (5, 3, 3, 3), (4, 5, 8, 8), (3, 3, 3, 5))
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    apart = mlir.Module.parse_text(_like(), CONVS)
    rewrite_weight_gradients(apart)
    stacked = mlir.Module.parse_text(_like(), CONVS)
    assert rewrite_weight_gradients(stacked, stacked=True) == 1
    assert _ops(stacked, "stablehlo.dot_general") == 1
    a, b = _run(apart, args)[2], _run(stacked, args)[2]
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a))
