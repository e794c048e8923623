"""Long float sums in blocks (stablehlo/blocked_sums.py; the runtime's ``blocked-sums``
rewrite, CPU only): which sums are blocked, that no level adds more than ``BLOCK``
values, that a second pass changes nothing, and that a blocked sum of a million float32
values is within the cascade's error bound of numpy's float64 sum where a sum in order is
not. numpy is the oracle; it shares no code with the rewrite or XLA."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from runtime_helpers import golden_bundle, golden_train_module, run_on_cpu

from stepbundle.runtime.compile import rewrites
from stepbundle.runtime.placement.sharding import Placement
from stepbundle.schema.reader import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.blocked_sums import BLOCK, LONG, block_long_sums, count_long_sums
from stepbundle.stablehlo.graph import ints, shape_of


def _module(text: str) -> mlir.Module:
    return mlir.Module.parse_text(golden_train_module("linear_adamw"), text)


def _sum(shape: list[int], dims: list[int], elem: str = "f32", body: str = "add") -> str:
    """A program of one reduce of an argument of ``shape`` over ``dims``."""
    t = "x".join(map(str, shape)) + "x" + elem
    out = [n for d, n in enumerate(shape) if d not in dims]
    o = "x".join(map(str, out)) + "x" + elem if out else elem
    return f"""
func.func @main(%x: tensor<{t}>) -> tensor<{o}> {{
  %z = stablehlo.constant dense<{"0" if elem.startswith("i") else "0.0"}> : tensor<{elem}>
  %r = stablehlo.reduce(%x init: %z) applies stablehlo.{body} across dimensions = {dims} : (tensor<{t}>, tensor<{elem}>) -> tensor<{o}>
  return %r : tensor<{o}>
}}
"""


def _levels(module: mlir.Module) -> list[int]:
    """How many values each reduce of ``module`` adds per result."""
    out = []
    with module._ctx:
        for op in module._operations():
            if op.name == "stablehlo.reduce":
                shape = shape_of(op.operands[0])
                out.append(math.prod(shape[d] for d in ints(op, "dimensions")))
    return out


@pytest.mark.parametrize(
    ("shape", "dims"),
    [
        ([32, 16, 64, 64], [0, 2, 3]),  # BatchNorm's statistics over N, H, W
        ([8191, 7], [0]),  # a prime count: padded with zeros
        ([1_000_000], [0]),
        ([64, 3, 4097], [0, 2]),
    ],
)
def test_every_level_of_a_blocked_sum_adds_at_most_a_block(
    shape: list[int], dims: list[int]
) -> None:
    module = _module(_sum(shape, dims))
    assert count_long_sums(module) == 1
    assert block_long_sums(module) == 1
    levels = _levels(module)
    assert len(levels) >= 2 and max(levels) <= BLOCK
    assert math.prod(levels) >= math.prod(shape[d] for d in dims)  # every value is in a block
    text = module.text()
    assert block_long_sums(module) == 0  # idempotent: nothing long is left
    assert module.text() == text


@pytest.mark.parametrize(
    "text",
    [
        _sum([LONG], [0]),  # not longer than LONG
        _sum([32, 16, 64, 64], [0, 2, 3], elem="f64"),  # float64: accurate enough
        _sum([32, 16, 64, 64], [0, 2, 3], body="maximum"),  # not a sum
        _sum([1 << 16], [0], elem="i32"),  # integers: exact
    ],
)
def test_short_float64_integer_and_other_reductions_are_left_alone(text: str) -> None:
    module = _module(text)
    before = module.text()
    assert count_long_sums(module) == 0
    assert block_long_sums(module) == 0
    assert module.text() == before


def _sequential_float32(x: np.ndarray) -> float:
    """The sum in order, in float32 (numpy's cumsum adds one value at a time)."""
    return float(np.cumsum(x, dtype=np.float32)[-1])


def test_a_blocked_million_value_sum_is_within_the_cascade_bound_of_float64() -> None:
    rng = np.random.default_rng(0)
    x = (0.1 + 0.001 * rng.standard_normal(1_000_000)).astype(np.float32)
    exact = float(np.sum(x.astype(np.float64)))
    module = _module(_sum([x.size], [0]))
    block_long_sums(module)
    levels = _levels(module)
    # A cascade whose levels add n_1, n_2, ... values is within (n_1 + n_2 + ...) * u *
    # sum|x| of the exact sum (u = 2^-24, float32's unit roundoff; first order).
    bound = sum(levels) * 2.0**-24 * float(np.sum(np.abs(x.astype(np.float64))))
    got = float(run_on_cpu(module, x)[0])
    in_order = _sequential_float32(x)
    print("blocked", abs(got - exact), "in order", abs(in_order - exact), "bound", bound)
    assert abs(got - exact) <= bound
    assert abs(in_order - exact) > 10 * bound  # the bound tells the two apart


@pytest.mark.parametrize(("shape", "dims"), [([32, 16, 64, 64], [0, 2, 3]), ([8191, 7], [0])])
def test_a_blocked_sum_adds_the_same_values(shape: list[int], dims: list[int]) -> None:
    """Split and padded dimensions keep every value once: the blocked sum of values
    whose float32 sums are exact in any order (small integers) equals numpy's."""
    rng = np.random.default_rng(1)
    x = rng.integers(-8, 9, size=shape).astype(np.float32)
    module = _module(_sum(shape, dims))
    block_long_sums(module)
    got = run_on_cpu(module, x)[0]
    assert np.array_equal(got, x.astype(np.float64).sum(axis=tuple(dims)))


def _stage() -> rewrites.Stage:
    with open_bundle(golden_bundle("batchnorm_lr")) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
    text = _sum([32, 16, 64, 64], [0, 2, 3])
    return rewrites.Stage(mlir.Module.parse_text(module, text), program)


@pytest.mark.parametrize(
    ("platform", "on", "applied"),
    [("cpu", True, True), ("cpu", False, False), ("tpu", True, False), ("cuda", True, False)],
)
def test_the_runtime_blocks_long_sums_on_the_cpu_only(
    platform: str, on: bool, applied: bool
) -> None:
    """TPUs and GPUs reduce in trees already (tiles, per-thread partial sums); ``on``
    False is ``STEPBUNDLE_CPU_BLOCKED_SUMS=0`` (cpu_numerics.py)."""
    stage = _stage()
    ctx = rewrites.RewriteContext(
        platform=platform, placement=Placement(jax.devices("cpu")[:1]), blocked_sums=on
    )
    out = rewrites.blocked_sums(stage, ctx)
    assert (out.module is not stage.module) is applied
    assert count_long_sums(out.module) == (0 if applied else 1)
    assert count_long_sums(stage.module) == 1  # a copy is rewritten, not the input
    assert ctx.notes.get("blocked_sums", 0) == (1 if applied else 0)
