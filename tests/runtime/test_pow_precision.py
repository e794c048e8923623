"""Adam's bias corrections computed exactly (stablehlo/pow_precision.py), pinned on the CPU.

A TPU v5e's float32 power was up to 52 ulp off, which moved the Adam golden bundles 4e-5
from the CPU in 6 steps; the runtime rewrites small float32 powers to whole exponents into
binary exponentiation in float64 on accelerators. The CPU cannot show the TPU's error, so
these tests pin what the rewritten program computes, run on the CPU: the correctly rounded
power (against numpy in float64, which shares no code with either), the backend's own
power for every exponent it does not take, and the golden Adam bundle's numbers.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from runtime_helpers import (
    GOLDEN_STEPS,
    golden_batches,
    golden_bundle,
    golden_expected,
    golden_train_module,
    run_on_cpu,
)

from stepbundle.runtime import LoadOptions, load
from stepbundle.runtime.compile import rewrites
from stepbundle.runtime.placement.sharding import Placement
from stepbundle.schema.reader import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.pow_precision import BITS, MAX_ELEMENTS, rewrite_powers

N = 64


def _like() -> mlir.Module:
    return golden_train_module("linear_adamw")


def _power_module(n: int) -> mlir.Module:
    text = f"""
func.func @main(%x: tensor<{n}xf32>, %y: tensor<{n}xf32>) -> tensor<{n}xf32> {{
  %p = stablehlo.power %x, %y : tensor<{n}xf32>
  return %p : tensor<{n}xf32>
}}
"""
    return mlir.Module.parse_text(_like(), text)


_run_all = run_on_cpu


def _run(module: mlir.Module, *args: np.ndarray) -> np.ndarray:
    return _run_all(module, *args)[0]


def _powers(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The power as XLA:CPU computes it; after the rewrite; and after the rewrite with its
    fallback (the backend's own power) made an addition, which shows which one answered
    (a CPU's power is correctly rounded too, so its values cannot)."""
    before = _run(_power_module(len(x)), x, y)
    module = _power_module(len(x))
    assert rewrite_powers(module) == 1
    text = module.text()
    assert text.count("stablehlo.power") == 1  # the fallback
    marked = mlir.Module.parse_text(_like(), text.replace("stablehlo.power", "stablehlo.add"))
    return before, _run(module, x, y), _run(marked, x, y)


def test_whole_exponents_give_the_correctly_rounded_power() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [[0.9, 0.999, 0.99, 0.95, 0.9999, 0.99999, 0.999999], rng.uniform(0.5, 1.2, N - 7)]
    ).astype(np.float32)
    y = np.concatenate(
        [[1, 2, 7, 1000, 10000, 65535, 2**BITS - 1], rng.integers(0, 400, N - 7)]
    ).astype(np.float32)
    _, after, marked = _powers(x, y)
    assert np.array_equal(after, marked)  # every one binary exponentiation
    exact = x.astype(np.float64) ** y.astype(np.float64)
    normal = np.abs(exact) >= np.finfo(np.float32).tiny  # XLA flushes subnormals to zero
    ulp = np.abs(after.astype(np.float64) - exact) / np.spacing(exact.astype(np.float32))
    # Half an ulp is correct rounding. Binary exponentiation's float64 roundings add a
    # relative error of about (y + 2 * BITS) * 2**-53 (each squaring doubles what the
    # base carries), and a float32 ulp is at least 2**-24 relative: near y = 2**24 that
    # is 1/32 ulp, which can round a value within it of a tie the other way.
    bound = 0.5 + (y.astype(np.float64) + 2 * BITS) * 2.0**-53 / 2.0**-24
    assert np.all(ulp[normal] <= bound[normal]), ulp.max()
    assert np.all(after[~normal] == 0)


def test_special_bases_match_float64() -> None:
    x = np.array([0.0, -0.0, -2.0, -0.5, np.inf, -np.inf, np.nan, np.nan, 1.0, 3.0], np.float32)
    y = np.array([0.0, 1.0, 3.0, 4.0, 2.0, 3.0, 0.0, 2.0, 12345.0, 5.0], np.float32)
    _, after, marked = _powers(x, y)
    assert np.array_equal(after, marked, equal_nan=True)
    with np.errstate(all="ignore"):
        ref = (x.astype(np.float64) ** y.astype(np.float64)).astype(np.float32)
    assert np.array_equal(after, ref, equal_nan=True)
    assert np.signbit(after[1])  # (-0) ** 1 is -0


def test_other_exponents_keep_the_backends_power() -> None:
    x = np.array([0.9, 0.999, 2.0, 0.5, 0.9, 4.0, 0.9, 1.5], np.float32)
    y = np.array([0.5, 1.25, -1.0, -3.0, 2.0**BITS, 1e30, np.nan, -np.inf], np.float32)
    before, after, marked = _powers(x, y)
    assert np.array_equal(before, after, equal_nan=True)
    assert np.array_equal(marked, x + y, equal_nan=True)  # every one the fallback


def test_only_small_float32_powers_are_rewritten() -> None:
    assert rewrite_powers(_power_module(MAX_ELEMENTS + 1)) == 0
    f64 = """
func.func @main(%x: tensor<f64>, %y: tensor<f64>) -> tensor<f64> {
  %p = stablehlo.power %x, %y : tensor<f64>
  return %p : tensor<f64>
}
"""
    assert rewrite_powers(mlir.Module.parse_text(_like(), f64)) == 0
    module = _like()  # Adam: two bias corrections per parameter tensor, computed together
    assert rewrite_powers(module) == 4
    assert module.text().count("stablehlo.power") == 1  # their shared fallback


def test_batching_alone_keeps_the_backends_powers() -> None:
    # exact=False (compile_variants.py measures it on a TPU): the batch, no float64.
    x = np.array([0.9, 0.999, 2.0, 0.5, 1.5], np.float32)
    y = np.array([7.0, 1000.0, -1.0, 0.5, 3.0], np.float32)
    before = _run(_power_module(len(x)), x, y)
    text = """
func.func @main(%x: tensor<3xf32>, %y: tensor<3xf32>, %a: tensor<2xf32>, %b: tensor<2xf32>)
    -> (tensor<3xf32>, tensor<2xf32>) {
  %p = stablehlo.power %x, %y : tensor<3xf32>
  %q = stablehlo.power %a, %b : tensor<2xf32>
  return %p, %q : tensor<3xf32>, tensor<2xf32>
}
"""
    module = mlir.Module.parse_text(_like(), text)
    assert rewrite_powers(module, exact=False) == 2
    assert module.text().count("stablehlo.power") == 1
    assert "f64" not in module.text()
    p, q = _run_all(module, x[:3], y[:3], x[3:], y[3:])
    assert np.array_equal(np.concatenate([p, q]), before)


def test_a_power_of_a_power_keeps_its_own() -> None:
    # Batched powers are computed together before the first of them; one whose operand
    # needs another power cannot join, and keeps the backend's power.
    text = """
func.func @main(%x: tensor<f32>, %y: tensor<f32>, %z: tensor<f32>) -> (tensor<f32>, tensor<f32>) {
  %p = stablehlo.power %x, %y : tensor<f32>
  %q = stablehlo.power %p, %z : tensor<f32>
  %s = stablehlo.add %y, %z : tensor<f32>
  %r = stablehlo.power %x, %s : tensor<f32>
  return %q, %r : tensor<f32>, tensor<f32>
}
"""
    module = mlir.Module.parse_text(_like(), text)
    assert rewrite_powers(module) == 2
    args = [np.float32(0.999), np.float32(7.0), np.float32(3.0)]
    q, r = _run_all(module, *args)
    exact = np.float64(args[0]) ** 10
    assert abs(float(r) - exact) <= 0.5 * np.spacing(np.float32(exact)) * (1 + 1e-6)
    assert np.isclose(float(q), np.float64(args[0]) ** 21, rtol=1e-6)  # (x**7)**3, the CPU's


def test_the_adam_golden_bundle_keeps_its_numbers_with_the_rewrite() -> None:
    # The runtime rewrites on accelerators only; forced here on the CPU, the rewritten
    # program must still be torch_xla eager's step (expected numbers within 1e-6).
    forced = tuple(
        (n, (lambda s, c: (rewrite_powers(s.module), s)[1]) if n == "power-precision" else r)
        for n, r in rewrites.REWRITES
    )
    assert any(n == "power-precision" for n, _ in forced)
    counts: list[int] = []
    forced = tuple(
        (n, (lambda s, c: (counts.append(rewrite_powers(s.module)), s)[1]))
        if n == "power-precision"
        else (n, r)
        for n, r in forced
    )
    kept, rewrites.REWRITES = rewrites.REWRITES, forced
    try:
        t = load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(),
        )
    finally:
        rewrites.REWRITES = kept
    assert sorted(counts) == [0, 0, 4, 4]  # two eval programs, two train programs
    ms = t.run(golden_batches("linear_adamw"), GOLDEN_STEPS["linear_adamw"])
    losses = np.array([float(m["loss"]) for m in ms])
    expected = golden_expected("linear_adamw")["metric/loss"]
    assert np.max(np.abs(losses - expected) / np.abs(expected)) < 1e-6


# A branch of `case` reads %late (and %p) from the enclosing block, not as operands.
CAPTURED = """
func.func @main(%x: tensor<f32>, %y: tensor<f32>, %i: tensor<i32>) -> (tensor<f32>, tensor<f32>, tensor<f32>) {
  %p = stablehlo.power %x, %y : tensor<f32>
  %late = stablehlo.add %y, %y : tensor<f32>
  %c = "stablehlo.case"(%i) ({
    stablehlo.return %late : tensor<f32>
  }, {
    stablehlo.return %y : tensor<f32>
  }) : (tensor<i32>) -> tensor<f32>
  %q = stablehlo.power %x, %c : tensor<f32>
  %d = "stablehlo.case"(%i) ({
    stablehlo.return %p : tensor<f32>
  }, {
    stablehlo.return %y : tensor<f32>
  }) : (tensor<i32>) -> tensor<f32>
  %r = stablehlo.power %x, %d : tensor<f32>
  return %p, %q, %r : tensor<f32>, tensor<f32>, tensor<f32>
}
"""


def test_values_a_region_reads_move_with_it() -> None:
    module = mlir.Module.parse_text(_like(), CAPTURED)
    # %q joins the batch (the case and %late move up with it); %r needs %p, so it keeps
    # the backend's power.
    assert rewrite_powers(module) == 2
    x, y = np.float32(0.999), np.float32(3.0)
    for i, e in ((0, 6.0), (1, 3.0)):  # branch 0 gives 2y, branch 1 gives y
        p, q, r = _run_all(module, x, y, np.int32(i))
        assert float(p) == np.float32(np.float64(x) ** 3)
        assert float(q) == np.float32(np.float64(x) ** e)
        assert np.isclose(float(r), np.float64(x) ** (np.float64(x) ** 3 if i == 0 else 3))


def test_ops_with_side_effects_are_not_moved() -> None:
    text = """
func.func @main(%x: tensor<f32>, %y: tensor<f32>) -> (tensor<f32>, tensor<f32>) {
  %p = stablehlo.power %x, %y : tensor<f32>
  %e = stablehlo.custom_call @stepbundle_test_effect(%y) {has_side_effect = true} : (tensor<f32>) -> tensor<f32>
  %q = stablehlo.power %x, %e : tensor<f32>
  return %p, %q : tensor<f32>, tensor<f32>
}
"""
    module = mlir.Module.parse_text(_like(), text)
    assert rewrite_powers(module) == 1  # %p; %q would move the custom call above it
    with module._ctx:
        names = [op.name for op in module.main.regions[0].blocks[0].operations]
    # The custom call still comes after the rewritten %p's float64 work, where it was.
    assert names.index("stablehlo.custom_call") > names.index("stablehlo.shift_right_logical")


@pytest.mark.parametrize(
    ("platform", "precision", "applied"),
    [
        ("tpu", "highest", True),
        ("tpu", "high", True),
        ("cuda", "highest", True),
        ("tpu", "default", False),  # bf16 passes: the larger error, and compile time saved
        ("tpu", None, False),
        ("cpu", "highest", False),  # powf is within an ulp already
    ],
)
def test_the_runtime_computes_powers_exactly_where_a_cpu_comparison_needs_it(
    platform: str, precision: str | None, applied: bool
) -> None:
    with open_bundle(golden_bundle("linear_adamw")) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
    ctx = rewrites.RewriteContext(
        platform=platform,
        placement=Placement(jax.devices("cpu")[:1]),
        matmul_precision=precision,
    )
    before = module.text().count("stablehlo.power")
    out = rewrites.power_precision(rewrites.Stage(module, program), ctx)
    assert before == 4
    assert (out.module.text().count("stablehlo.power") == 1) is applied
    assert module.text().count("stablehlo.power") == 4  # a copy is rewritten, not the input
