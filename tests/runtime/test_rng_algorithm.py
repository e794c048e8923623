"""Dropout masks do not depend on the device: rng_bit_generator's DEFAULT is pinned.

A TPU's DEFAULT draws other bits than the CPU's (benchmarks/results/device/tpu-v5e/
rng.json); the runtime rewrites DEFAULT to PHILOX, which is what the CPU's DEFAULT is.
These tests pin, on the CPU, what the program asks for after the rewrite and that the
CPU's numbers did not move.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import lax
from runtime_helpers import GOLDEN_STEPS, golden_batches, golden_bundle, golden_expected

from stepbundle.runtime import _compat, load
from stepbundle.schema.reader import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.rng_algorithm import pin_rng_algorithm


def _train_module(name: str) -> mlir.Module:
    with open_bundle(golden_bundle(name)) as b:
        program = b.manifest.entries["train"].programs[0]
        return mlir.parse_artifact(bytes(b.section(program.section)))


def _algorithms(module: mlir.Module) -> list[str]:
    """Each rng_bit_generator's algorithm, as the attribute prints (jax versions print the
    op's text differently; the attribute names the algorithm in both)."""
    with module._ctx:
        return [
            str(op.attributes["rng_algorithm"]).split()[-1].strip(">")
            for op in module._operations()
            if op.name == "stablehlo.rng_bit_generator"
        ]


def test_the_dropout_program_asks_for_philox_after_the_rewrite() -> None:
    module = _train_module("dropout_sgd")
    before = _algorithms(module)
    assert before and set(before) == {"DEFAULT"}  # what torch_xla wrote
    assert pin_rng_algorithm(module) == len(before)
    assert set(_algorithms(module)) == {"PHILOX"}
    assert pin_rng_algorithm(module) == 0  # idempotent


def test_explicit_algorithms_and_other_state_shapes_are_left_alone() -> None:
    like = _train_module("dropout_sgd")
    text = """
func.func @main(%a: tensor<2xui64>, %b: tensor<4xui32>) -> (tensor<8xui32>, tensor<8xui32>) {
  %s1, %o1 = stablehlo.rng_bit_generator %a, algorithm = THREE_FRY : (tensor<2xui64>) -> (tensor<2xui64>, tensor<8xui32>)
  %s2, %o2 = stablehlo.rng_bit_generator %b, algorithm = DEFAULT : (tensor<4xui32>) -> (tensor<4xui32>, tensor<8xui32>)
  return %o1, %o2 : tensor<8xui32>, tensor<8xui32>
}
"""
    module = mlir.Module.parse_text(like, text)
    assert pin_rng_algorithm(module) == 0
    assert sorted(_algorithms(module)) == ["DEFAULT", "THREE_FRY"]


@pytest.mark.parametrize("seed", [0, 2024, 2**63 + 12345])
def test_on_the_cpu_default_is_philox_bit_for_bit(seed: int) -> None:
    # The premise that makes the rewrite free on the CPU; if an XLA release changed its
    # CPU default, this fails and the pin would have moved CPU results.
    def draw(algorithm: lax.RandomAlgorithm) -> np.ndarray:
        with _compat.x64_scope():
            state = jax.device_put(
                np.array([seed, 1012031], dtype=np.uint64), jax.devices("cpu")[0]
            )
            _, bits = jax.jit(lambda s: lax.rng_bit_generator(s, (64, 33), np.uint32, algorithm))(
                state
            )
            return np.asarray(bits)

    default = draw(lax.RandomAlgorithm.RNG_DEFAULT)
    assert np.array_equal(default, draw(lax.RandomAlgorithm.RNG_PHILOX))
    assert not np.array_equal(default, draw(lax.RandomAlgorithm.RNG_THREE_FRY))


def test_the_pinned_dropout_bundle_still_draws_torch_xla_eager_masks_on_the_cpu() -> None:
    # Other masks would put the losses O(1) apart (2.2 relative on a TPU before the pin).
    t = load(golden_bundle("dropout_sgd"))
    ms = t.run(golden_batches("dropout_sgd"), GOLDEN_STEPS["dropout_sgd"])
    losses = np.array([float(m["loss"]) for m in ms])
    expected = golden_expected("dropout_sgd")["metric/loss"]
    assert np.max(np.abs(losses - expected) / np.abs(expected)) < 1e-6
