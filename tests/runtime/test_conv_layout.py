"""stablehlo/conv_layout.py: every convolution in NHWC/HWIO order, the window kept.

The numbers are checked end to end in tests/exporter/test_steps_per_call_conv.py (a CNN's
K-step loop bit for bit its single steps); here, the rewrite's form on MLIR's own text.
"""

from __future__ import annotations

from runtime_helpers import golden_bundle

import stepbundle.schema as codec
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.conv_layout import canonicalize_convolutions

NCHW = """
func.func @main(%x: tensor<2x3x9x9xf32>, %k: tensor<5x3x3x3xf32>) -> tensor<2x5x4x4xf32> {
  %c = stablehlo.convolution(%x, %k) dim_numbers = [b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1],
         window = {stride = [2, 2], pad = [[0, 1], [1, 0]], rhs_dilate = [1, 1]}
         {batch_group_count = 1 : i64, feature_group_count = 1 : i64}
         : (tensor<2x3x9x9xf32>, tensor<5x3x3x3xf32>) -> tensor<2x5x4x4xf32>
  return %c : tensor<2x5x4x4xf32>
}
"""


def _module(text: str) -> mlir.Module:
    bundle = codec.open_bundle(golden_bundle("linear_adamw"))
    like = mlir.parse_artifact(bundle.section(bundle.manifest.entries["train"].programs[0].section))
    return mlir.Module.parse_text(like, text)


def test_an_nchw_convolution_is_reordered_with_its_window_kept() -> None:
    module = _module(NCHW)
    assert canonicalize_convolutions(module) == 1
    text = module.text()
    assert "[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]" in text, text
    assert "stride = [2, 2]" in text and "pad = [[0, 1], [1, 0]]" in text
    assert text.count("stablehlo.transpose") == 3
    assert "dims = [0, 2, 3, 1]" in text  # input to NHWC
    assert "dims = [2, 3, 1, 0]" in text  # kernel OIHW to HWIO
    assert "dims = [0, 3, 1, 2]" in text  # the result back to NCHW
    assert canonicalize_convolutions(module) == 0  # already in order: left alone


def test_a_module_without_convolutions_is_unchanged() -> None:
    bundle = codec.open_bundle(golden_bundle("linear_adamw"))
    module = mlir.parse_artifact(
        bundle.section(bundle.manifest.entries["train"].programs[0].section)
    )
    before = module.text()
    assert canonicalize_convolutions(module) == 0
    assert module.text() == before
