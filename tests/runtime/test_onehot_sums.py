"""Sums over a one-hot of the targets as the values at the targets (stablehlo/onehot.py),
pinned on the CPU: which sums the rewrite takes (the form torch_xla writes for
cross_entropy, and jax's one_hot), which it leaves alone, and that the rewritten program
computes what the original did (per-token sums bit for bit, the loss against numpy in
float64, which shares no code with either)."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import golden_train_module, run_on_cpu

from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.onehot import count_onehot_reductions, rewrite_onehot_reductions

N, V = 6, 10

# torch_xla 2.9's cross_entropy(logits.reshape(-1, V), target.reshape(-1)) at a small
# size, op for op as it writes it in a training step (benchmarks/device/gpt.py's loss):
# the one-hot, the ignore_index mask (int32 targets here: the test's jax runs without
# x64), the count, the loss, and the backward's per-token
# sum of the one-hot over the count.
CROSS_ENTROPY = """
func.func @main(%x: tensor<2x3x10xf32>, %t: tensor<2x3xi32>) -> (tensor<f32>, tensor<f32>, tensor<6xf32>, tensor<6xf32>) {
  %zeros = stablehlo.constant dense<0.0> : tensor<6x10xf32>
  %ones = stablehlo.constant dense<1.0> : tensor<6x10xf32>
  %ign = stablehlo.constant dense<-100> : tensor<6xi32>
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32>
  %tf = stablehlo.reshape %t : (tensor<2x3xi32>) -> tensor<6xi32>
  %tb = stablehlo.broadcast_in_dim %tf, dims = [0] : (tensor<6xi32>) -> tensor<6x10xi32>
  %io = stablehlo.iota dim = 0 : tensor<10xi32>
  %ib = stablehlo.broadcast_in_dim %io, dims = [1] : (tensor<10xi32>) -> tensor<6x10xi32>
  %hot = stablehlo.compare EQ, %tb, %ib : (tensor<6x10xi32>, tensor<6x10xi32>) -> tensor<6x10xi1>
  %oh = stablehlo.select %hot, %ones, %zeros : tensor<6x10xi1>, tensor<6x10xf32>
  %noh = stablehlo.negate %oh : tensor<6x10xf32>
  %keep = stablehlo.compare NE, %tf, %ign : (tensor<6xi32>, tensor<6xi32>) -> tensor<6xi1>
  %keepb = stablehlo.broadcast_in_dim %keep, dims = [0] : (tensor<6xi1>) -> tensor<6x10xi1>
  %w = stablehlo.select %keepb, %ones, %zeros : tensor<6x10xi1>, tensor<6x10xf32>
  %wo = stablehlo.multiply %w, %oh : tensor<6x10xf32>
  %count = stablehlo.reduce(%wo init: %z) applies stablehlo.add across dimensions = [0, 1] : (tensor<6x10xf32>, tensor<f32>) -> tensor<f32>
  %xf = stablehlo.reshape %x : (tensor<2x3x10xf32>) -> tensor<6x10xf32>
  %m = stablehlo.reduce(%xf init: %ninf) applies stablehlo.maximum across dimensions = [1] : (tensor<6x10xf32>, tensor<f32>) -> tensor<6xf32>
  %mb = stablehlo.broadcast_in_dim %m, dims = [0] : (tensor<6xf32>) -> tensor<6x10xf32>
  %s = stablehlo.subtract %xf, %mb : tensor<6x10xf32>
  %e = stablehlo.exponential %s : tensor<6x10xf32>
  %se = stablehlo.reduce(%e init: %z) applies stablehlo.add across dimensions = [1] : (tensor<6x10xf32>, tensor<f32>) -> tensor<6xf32>
  %l = stablehlo.log %se : tensor<6xf32>
  %lb = stablehlo.broadcast_in_dim %l, dims = [0] : (tensor<6xf32>) -> tensor<6x10xf32>
  %lp = stablehlo.subtract %s, %lb : tensor<6x10xf32>
  %notone = stablehlo.compare NE, %oh, %ones : (tensor<6x10xf32>, tensor<6x10xf32>) -> tensor<6x10xi1>
  %prod = stablehlo.multiply %noh, %lp : tensor<6x10xf32>
  %sel = stablehlo.select %notone, %zeros, %prod : tensor<6x10xi1>, tensor<6x10xf32>
  %wl = stablehlo.multiply %sel, %wo : tensor<6x10xf32>
  %sum = stablehlo.reduce(%wl init: %z) applies stablehlo.add across dimensions = [0, 1] : (tensor<6x10xf32>, tensor<f32>) -> tensor<f32>
  %loss = stablehlo.divide %sum, %count : tensor<f32>
  %cb = stablehlo.broadcast_in_dim %count, dims = [] : (tensor<f32>) -> tensor<6x10xf32>
  %g = stablehlo.multiply %noh, %wo : tensor<6x10xf32>
  %gd = stablehlo.divide %g, %cb : tensor<6x10xf32>
  %row = stablehlo.reduce(%gd init: %z) applies stablehlo.add across dimensions = [1] : (tensor<6x10xf32>, tensor<f32>) -> tensor<6xf32>
  %picked = stablehlo.reduce(%wl init: %z) applies stablehlo.add across dimensions = [1] : (tensor<6x10xf32>, tensor<f32>) -> tensor<6xf32>
  return %loss, %count, %row, %picked : tensor<f32>, tensor<f32>, tensor<6xf32>, tensor<6xf32>
}
"""

# jax.nn.one_hot's form (a converted predicate, the target broadcast through a unit
# dimension) in a 3-D frame: the per-token logit at the target, the class axis last.
JAX_ONE_HOT = """
func.func @main(%x: tensor<2x3x10xf32>, %t: tensor<2x3xi32>) -> tensor<2x3xf32> {
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %t1 = stablehlo.broadcast_in_dim %t, dims = [0, 1] : (tensor<2x3xi32>) -> tensor<2x3x1xi32>
  %tb = stablehlo.broadcast_in_dim %t1, dims = [0, 1, 2] : (tensor<2x3x1xi32>) -> tensor<2x3x10xi32>
  %io = stablehlo.iota dim = 0 : tensor<10xi32>
  %i1 = stablehlo.broadcast_in_dim %io, dims = [2] : (tensor<10xi32>) -> tensor<1x1x10xi32>
  %ib = stablehlo.broadcast_in_dim %i1, dims = [0, 1, 2] : (tensor<1x1x10xi32>) -> tensor<2x3x10xi32>
  %hot = stablehlo.compare EQ, %tb, %ib, SIGNED : (tensor<2x3x10xi32>, tensor<2x3x10xi32>) -> tensor<2x3x10xi1>
  %oh = stablehlo.convert %hot : (tensor<2x3x10xi1>) -> tensor<2x3x10xf32>
  %p = stablehlo.multiply %oh, %x : tensor<2x3x10xf32>
  %r = stablehlo.reduce(%p init: %z) applies stablehlo.add across dimensions = [2] : (tensor<2x3x10xf32>, tensor<f32>) -> tensor<2x3xf32>
  return %r : tensor<2x3xf32>
}
"""


def _module(text: str) -> mlir.Module:
    return mlir.Module.parse_text(golden_train_module("linear_adamw"), text)


def _ops(module: mlir.Module, name: str) -> int:
    """Operations ``name`` whose result is used (a rewritten sum is left unused)."""
    return sum(
        op.name == name and any(True for _ in op.results[0].uses) for op in module._operations()
    )


def _targets() -> np.ndarray:
    # Two ignored (-100), one past the vocabulary and one negative: all select nothing.
    return np.array([[3, -100, 9], [0, 12, -3]], dtype=np.int32).reshape(2, 3)


def test_torch_xla_cross_entropy_sums_are_rewritten() -> None:
    module = _module(CROSS_ENTROPY)
    assert count_onehot_reductions(module) == 4  # the count, loss, per-token sums
    assert rewrite_onehot_reductions(module) == 4
    # Left: the row max and the sum of exponentials, which read every class, and the
    # count's and the loss's sums over the tokens.
    assert _ops(module, "stablehlo.reduce") == 4
    assert _ops(module, "stablehlo.gather") == 2  # the logits at the targets, per sum
    assert rewrite_onehot_reductions(module) == 0


def test_the_rewritten_cross_entropy_computes_the_same() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 3, V)) * 3).astype(np.float32)
    t = _targets()
    before = run_on_cpu(_module(CROSS_ENTROPY), x, t)
    rewritten = _module(CROSS_ENTROPY)
    rewrite_onehot_reductions(rewritten)
    after = run_on_cpu(rewritten, x, t)
    # numpy, float64: the log-probability at each target that is a class, not ignored.
    tf, xf = t.reshape(-1), x.reshape(N, V).astype(np.float64)
    valid = (tf >= 0) & (tf < V)
    logp = xf - xf.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    at = np.where(valid, logp[np.arange(N), np.clip(tf, 0, V - 1)], 0.0)
    count = valid.sum()
    assert count == 3
    for got in (before, after):
        assert abs(got[0] - (-at.sum() / count)) <= 1e-6 * abs(at.sum() / count)
        assert got[1] == count
        np.testing.assert_allclose(got[3], -at, rtol=1e-6)
    # Per token, a sum of one value and zeros: the same bits.
    for a, b in zip(before[1:], after[1:]):
        assert np.array_equal(a, b)
    np.testing.assert_array_equal(after[2], np.where(valid, -1.0 / count, 0.0).astype(np.float32))


def test_jax_one_hot_form_is_rewritten_and_exact() -> None:
    module = _module(JAX_ONE_HOT)
    assert rewrite_onehot_reductions(module) == 1
    assert _ops(module, "stablehlo.reduce") == 0
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, V)).astype(np.float32)
    t = np.array([[1, 9, 10], [-1, 0, 4]], dtype=np.int32)
    got = run_on_cpu(module, x, t)[0]
    want = np.where(
        (t >= 0) & (t < V), np.take_along_axis(x, np.clip(t, 0, V - 1)[..., None], 2)[..., 0], 0
    )
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, run_on_cpu(_module(JAX_ONE_HOT), x, t)[0])


# Sums that are not over a one-hot: each replaces the product in JAX_ONE_HOT.
NOT_ONE_HOT = {
    # label smoothing's sum of every class's value
    "every class": ("%p = stablehlo.multiply %oh, %x", "%p = stablehlo.add %x, %x"),
    # a one-hot plus something else is not zero off the target
    "a sum with another term": ("%p = stablehlo.multiply %oh, %x", "%p = stablehlo.add %oh, %x"),
    # the complement of a one-hot: one everywhere but the target
    "a one-hot's complement": ("%hot = stablehlo.compare EQ", "%hot = stablehlo.compare NE"),
    # a predicate that is not ``iota == target`` (<=): many classes per token
    "a comparison other than ==": ("%hot = stablehlo.compare EQ", "%hot = stablehlo.compare LE"),
    # the sum starts from 1, not 0
    "a nonzero start": ("%z = stablehlo.constant dense<0.0>", "%z = stablehlo.constant dense<1.0>"),
    # a maximum is not a sum
    "a max": ("applies stablehlo.add", "applies stablehlo.maximum"),
}


@pytest.mark.parametrize("case", sorted(NOT_ONE_HOT))
def test_other_sums_are_left_alone(case: str) -> None:
    old, new = NOT_ONE_HOT[case]
    assert old in JAX_ONE_HOT
    module = _module(JAX_ONE_HOT.replace(old, new))
    assert count_onehot_reductions(module) == 0
    assert rewrite_onehot_reductions(module) == 0


def test_a_sum_across_the_tokens_only_is_left_alone() -> None:
    # The one-hot runs along the classes; a sum over the tokens keeps every class.
    text = JAX_ONE_HOT.replace("dimensions = [2]", "dimensions = [1]").replace(
        "-> tensor<2x3xf32>\n  return %r : tensor<2x3xf32>",
        "-> tensor<2x10xf32>\n  return %r : tensor<2x10xf32>",
    )
    text = text.replace("-> tensor<2x3xf32> {", "-> tensor<2x10xf32> {")
    module = _module(text)
    assert count_onehot_reductions(module) == 0


def test_the_runtime_rewrites_a_golden_cross_entropy() -> None:
    # dropout_sgd's step is cross_entropy on torch_xla 2.9 (tests/golden/golden_recipes.py).
    import jax
    from runtime_helpers import golden_bundle

    from stepbundle.runtime.compile.rewrites import RewriteContext, Stage, onehot_sums
    from stepbundle.runtime.placement.sharding import Placement
    from stepbundle.schema.reader import open_bundle

    module = golden_train_module("dropout_sgd")
    assert count_onehot_reductions(module) == 3
    with open_bundle(golden_bundle("dropout_sgd")) as b:
        program = b.manifest.entries["train"].programs[0]
    ctx = RewriteContext(platform="cpu", placement=Placement(jax.devices("cpu")[:1]))
    out = onehot_sums(Stage(module, program), ctx)
    assert out.module is not module  # rewritten on a copy
    assert count_onehot_reductions(out.module) == 0
    assert count_onehot_reductions(module) == 3


# Forms whose arithmetic differs from Python's numbers, or that break the 0 * x = 0 reading:
# each must be left alone (or rewritten to the same values). A shared head: x (4, 5),
# t (4,), the one-hot predicate; each case ends in ``%s``, summed over the classes.
HEAD = """
func.func @main(%x: tensor<4x5xf32>, %t: tensor<4xi32>) -> tensor<4xf32> {
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %zf = stablehlo.constant dense<0.0> : tensor<4x5xf32>
  %onef = stablehlo.constant dense<1.0> : tensor<4x5xf32>
  %one = stablehlo.constant dense<1> : tensor<4x5xi32>
  %zi = stablehlo.constant dense<0> : tensor<4x5xi32>
  %zu = stablehlo.constant dense<0> : tensor<4x5xui32>
  %tb = stablehlo.broadcast_in_dim %t, dims = [0] : (tensor<4xi32>) -> tensor<4x5xi32>
  %io = stablehlo.iota dim = 1 : tensor<4x5xi32>
  %hot = stablehlo.compare EQ, %io, %tb : (tensor<4x5xi32>, tensor<4x5xi32>) -> tensor<4x5xi1>
"""
TAIL = """
  %r = stablehlo.reduce(%s init: %z) applies stablehlo.add across dimensions = [1] : (tensor<4x5xf32>, tensor<f32>) -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"""
ODD_FORMS = {
    # -1 converted to unsigned is 4294967295, not -1: "< 0" is never true
    "a negative one-hot converted to unsigned": """
  %ind = stablehlo.select %hot, %zi, %one : tensor<4x5xi1>, tensor<4x5xi32>
  %neg = stablehlo.negate %ind : tensor<4x5xi32>
  %u = stablehlo.convert %neg : (tensor<4x5xi32>) -> tensor<4x5xui32>
  %p = stablehlo.compare LT, %u, %zu : (tensor<4x5xui32>, tensor<4x5xui32>) -> tensor<4x5xi1>
  %s = stablehlo.select %p, %zf, %x : tensor<4x5xi1>, tensor<4x5xf32>""",
    # under TOTALORDER -0.0 and 0.0 differ
    "a total-order comparison": """
  %nz = stablehlo.constant dense<-0.0> : tensor<4x5xf32>
  %ind = stablehlo.select %hot, %onef, %nz : tensor<4x5xi1>, tensor<4x5xf32>
  %p = stablehlo.compare EQ, %ind, %zf, TOTALORDER : (tensor<4x5xf32>, tensor<4x5xf32>) -> tensor<4x5xi1>
  %s = stablehlo.select %p, %x, %zf : tensor<4x5xi1>, tensor<4x5xf32>""",
    # (one-hot * x) / one-hot is NaN off the target (0 / 0)
    "a quotient by the one-hot": """
  %oh = stablehlo.select %hot, %onef, %zf : tensor<4x5xi1>, tensor<4x5xf32>
  %m = stablehlo.multiply %oh, %x : tensor<4x5xf32>
  %s = stablehlo.divide %m, %oh : tensor<4x5xf32>""",
    # a select that takes x off the target is not zero there
    "x off the target": """
  %s = stablehlo.select %hot, %zf, %x : tensor<4x5xi1>, tensor<4x5xf32>""",
}


@pytest.mark.parametrize("case", sorted(ODD_FORMS))
def test_odd_forms_keep_their_values(case: str) -> None:
    text = HEAD + ODD_FORMS[case] + TAIL
    x = np.arange(20, dtype=np.float32).reshape(4, 5) + 1
    t = np.array([0, 1, 2, 4], dtype=np.int32)
    module = _module(text)
    assert rewrite_onehot_reductions(module) == 0
    np.testing.assert_array_equal(run_on_cpu(module, x, t)[0], run_on_cpu(_module(text), x, t)[0])


def test_a_narrow_target_is_left_alone() -> None:
    # An int8 iota over 200 classes wraps: 128 of its values repeat, several hot per row.
    text = JAX_ONE_HOT.replace("10x", "200x").replace("xi32>", "xi8>").replace("2x3xi32", "2x3xi8")
    text = text.replace("x: tensor<2x3x10xf32>", "x: tensor<2x3x200xf32>")
    text = text.replace("tensor<2x3x10xf32>", "tensor<2x3x200xf32>").replace(
        "tensor<10xi8>", "tensor<200xi8>"
    )
    module = _module(text)
    assert count_onehot_reductions(module) == 0


def test_programs_it_cannot_read_load_as_they_are() -> None:
    # A complex sum and a chain deeper than the rewrite follows: no error, nothing taken.
    complex_sum = """
func.func @main(%x: tensor<4x5xcomplex<f32>>) -> tensor<4xcomplex<f32>> {
  %z = stablehlo.constant dense<(0.0, 0.0)> : tensor<complex<f32>>
  %r = stablehlo.reduce(%x init: %z) applies stablehlo.add across dimensions = [1] : (tensor<4x5xcomplex<f32>>, tensor<complex<f32>>) -> tensor<4xcomplex<f32>>
  return %r : tensor<4xcomplex<f32>>
}
"""
    assert count_onehot_reductions(_module(complex_sum)) == 0
    lines = [
        HEAD.strip("\n"),
        "  %oh = stablehlo.select %hot, %onef, %zf : tensor<4x5xi1>, tensor<4x5xf32>",
        "  %v0 = stablehlo.multiply %oh, %x : tensor<4x5xf32>",
    ]
    lines += [
        f"  %v{i} = stablehlo.multiply %v{i - 1}, %x : tensor<4x5xf32>" for i in range(1, 400)
    ]
    deep = "\n".join(lines) + "\n  %s = stablehlo.multiply %v399, %onef : tensor<4x5xf32>" + TAIL
    assert count_onehot_reductions(_module(deep)) == 0  # 400 deep: not followed
