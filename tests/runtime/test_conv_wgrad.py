"""Weight-gradient convolutions as a loop over rows (stablehlo/conv_wgrad.py), pinned on
the CPU: which convolutions the rewrite takes (the StableHLO form that took a TPU's
compiler 45-61 s: a map-sized window), that no convolution with a map-sized window is
left, and that the rewritten program computes the convolution (against numpy in float64,
which shares no code with either)."""

from __future__ import annotations

import numpy as np
import pytest
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


def _windows(module: mlir.Module) -> list[int]:
    """The window size (kernel operand's spatial elements) of every convolution, loop
    bodies included."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo as hlo

    out = []
    with module._ctx:
        for op in module._operations():
            if op.name == "stablehlo.convolution":
                dn = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
                shape = ir.RankedTensorType(op.operands[1].type).shape
                out.append(int(np.prod([shape[d] for d in dn.kernel_spatial_dimensions])))
    return sorted(out)


def test_only_the_weight_gradient_is_rewritten() -> None:
    module = mlir.Module.parse_text(_like(), CONVS)
    assert _windows(module) == [9, 9, 64]  # forward, input gradient, weight gradient (8x8)
    assert rewrite_weight_gradients(module) == 1
    # The forward and input gradient stay; the weight gradient's window is 4 rows of 8.
    assert _windows(module) == [9, 9, 32]
    assert _ops(module, "stablehlo.while") == 1
    assert rewrite_weight_gradients(module) == 0


def test_positions_form_writes_one_product_per_position() -> None:
    module = mlir.Module.parse_text(_like(), CONVS)
    assert rewrite_weight_gradients(module, form="positions") == 1
    assert _windows(module) == [9, 9]
    assert _ops(module, "stablehlo.dot_general") == 9  # one per 3x3 output position


def _reference(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """numpy, float64: dw[kh, kw, c, o] = sum_{n, h, w} xpad[n, c, h + kh, w + kw] dy[n, o, h, w]."""
    h, w = x.shape[2:]
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    ref = np.zeros((3, 3, x.shape[1], dy.shape[1]))
    for kh in range(3):
        for kw in range(3):
            ref[kh, kw] = np.einsum("nchw,nohw->co", xp[:, :, kh : kh + h, kw : kw + w], dy)
    return ref


@pytest.mark.parametrize("form", ["rows", "positions"])
def test_the_rewritten_weight_gradient_is_the_convolution(form: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((4, 5, 8, 8)).astype(np.float32)
    w2 = rng.standard_normal((3, 3, 3, 5)).astype(np.float32)
    ref = _reference(x, dy)
    args = [x, w, dy, w2]
    before = _run(mlir.Module.parse_text(_like(), CONVS), args)
    rewritten = mlir.Module.parse_text(_like(), CONVS)
    rewrite_weight_gradients(rewritten, form=form)
    after = _run(rewritten, args)
    scale = np.max(np.abs(ref))
    assert np.max(np.abs(before[2] - ref)) / scale < 1e-6  # XLA's convolution
    assert np.max(np.abs(after[2] - ref)) / scale < 1e-6  # the rewrite
    for a, b in zip(before[:2], after[:2]):  # the other convolutions are untouched
        assert np.array_equal(a, b)


@pytest.mark.parametrize("width", [32, 4])
def test_rows_per_iteration_keep_the_window_small(width: int) -> None:
    """A row of 32 elements is one iteration's window; rows of 4 go 8 at a time (a window
    of 32), in jax's output order ``[f, b, 0, 1]``, without padding along the rows."""
    text = (
        "func.func @main(%x: tensor<2x3x16xWxf32>, %dy: tensor<2x5x16xWxf32>) -> tensor<5x3x1x3xf32> {\n"
        "  %dw = stablehlo.convolution(%x, %dy) dim_numbers = [f, b, 0, 1]x[i, o, 0, 1]->[f, b, 0, 1], "
        "window = {pad = [[0, 0], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} "
        ": (tensor<2x3x16xWxf32>, tensor<2x5x16xWxf32>) -> tensor<5x3x1x3xf32>\n"
        "  return %dw : tensor<5x3x1x3xf32>\n}\n"
    ).replace("W", str(width))
    module = mlir.Module.parse_text(_like(), text)
    assert rewrite_weight_gradients(module) == 1
    assert _windows(module) == [width * (1 if width == 32 else 8)]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 16, width)).astype(np.float32)
    dy = rng.standard_normal((2, 5, 16, width)).astype(np.float32)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (0, 0), (1, 1)))
    ref = np.stack(
        [np.einsum("nchw,nohw->co", xp[..., kw : kw + width], dy) for kw in range(3)], -1
    )
    got = _run(module, [x, dy])[0][:, :, 0, :].transpose(1, 0, 2)
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 1e-6


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


def _wgrad_text(n: int, c: int, o: int, h: int, w: int, dtype: str = "f32") -> str:
    """torch_xla's weight-gradient convolution of a 3x3 layer with padding 1 on an h x w
    map (a 1 x w map: a Conv1d's, padding only along w)."""
    kh, ph = (1, 0) if h == 1 else (3, 1)
    x, dy, dw = (
        f"tensor<{n}x{c}x{h}x{w}x{dtype}>",
        f"tensor<{n}x{o}x{h}x{w}x{dtype}>",
        f"tensor<{kh}x3x{c}x{o}x{dtype}>",
    )
    return (
        f"func.func @main(%x: {x}, %dy: {dy}) -> {dw} {{\n"
        f"  %dw = stablehlo.convolution(%x, %dy) dim_numbers = [f, b, 0, 1]x[i, o, 0, 1]->[0, 1, b, f], "
        f"window = {{pad = [[{ph}, {ph}], [1, 1]]}} "
        f"{{batch_group_count = 1 : i64, feature_group_count = 1 : i64}} : ({x}, {dy}) -> {dw}\n"
        f"  return %dw : {dw}\n}}\n"
    )


def test_a_rewritten_convolution_is_not_taken_again() -> None:
    # Rows of 64 elements: each iteration's window is one whole row (64 > ROW_WINDOW).
    module = mlir.Module.parse_text(_like(), _wgrad_text(2, 3, 4, 64, 64))
    assert rewrite_weight_gradients(module) == 1
    assert _windows(module) == [64]
    assert rewrite_weight_gradients(module) == 0
    assert _ops(module, "stablehlo.while") == 1


def test_a_one_row_map_is_left_alone() -> None:
    # A Conv1d's weight gradient (torch_xla writes a 1 x L map): one iteration would
    # change nothing.
    module = mlir.Module.parse_text(_like(), _wgrad_text(2, 3, 4, 1, 100))
    assert _windows(module) == [100]
    assert rewrite_weight_gradients(module) == 0


def test_a_bf16_weight_gradient_is_summed_in_float32() -> None:
    """Rounded to bf16 once, as XLA's convolution does: summed in bf16 row by row, the
    error of a 32x32 map's gradient was 3x larger (9.1e-3 against 2.8e-3)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")  # jax's own dependency
    rng = np.random.default_rng(4)
    bf16 = ml_dtypes.bfloat16
    x = rng.standard_normal((8, 3, 32, 32)).astype(bf16)
    dy = rng.standard_normal((8, 8, 32, 32)).astype(bf16)
    ref = _reference(x.astype(np.float64), dy.astype(np.float64))  # the rounded inputs, exactly
    module = mlir.Module.parse_text(_like(), _wgrad_text(8, 3, 8, 32, 32, "bf16"))
    assert rewrite_weight_gradients(module) == 1
    got = _run(module, [x, dy])[0].astype(np.float64)
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err < 2**-8  # one rounding to bf16 (8 bits of mantissa), not one per row


# A forward convolution whose filter covers its whole map (an 8x8 kernel over an 8x8
# map, no padding: one output position): by shape it is a map-sized window, like a
# weight gradient's, and the rewrite takes it too (conv_wgrad's docstring says so).
BIG_FILTER = """
func.func @main(%x: tensor<2x3x8x8xf32>, %w: tensor<4x3x8x8xf32>) -> tensor<2x4x1x1xf32> {
  %y = stablehlo.convolution(%x, %w) dim_numbers = [b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1], window = {} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<2x3x8x8xf32>, tensor<4x3x8x8xf32>) -> tensor<2x4x1x1xf32>
  return %y : tensor<2x4x1x1xf32>
}
"""


def test_a_forward_convolution_with_a_map_sized_filter_is_rewritten_and_computes_it() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    w = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    ref = np.einsum("nchw,ochw->no", x.astype(np.float64), w.astype(np.float64))
    module = mlir.Module.parse_text(_like(), BIG_FILTER)
    assert _windows(module) == [64]
    assert rewrite_weight_gradients(module) == 1
    assert _windows(module) == [32]  # 4 rows of 8 per iteration
    assert _ops(module, "stablehlo.while") == 1
    got = _run(module, [x, w])[0][:, :, 0, 0].astype(np.float64)
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 1e-6
    # The usual forward convolution (a 3x3 filter) is not: test_only_the_weight_gradient_is_rewritten.
