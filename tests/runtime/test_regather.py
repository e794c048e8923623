"""The ``regather-weights`` rewrite (#41, ``stablehlo/regather.py``): under a layout that
splits parameters over the data axis, every product of a parameter after its first reads
its own copy behind a barrier tied to the product's other operand, so that the SPMD
partitioner gathers the weight again next to the backward's use. Held here: the form of
the rewritten StableHLO, that a second pass adds nothing, that it changes no bit, and that
the runtime applies it to ``fsdp`` and ``fsdp+tp`` only (``test_layouts.py`` runs the
GPT with and without it on 4 devices and compares the bits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jaxlib.mlir import ir
from runtime_helpers import golden_train_module, run_on_cpu

from stepbundle.runtime import _compat
from stepbundle.runtime.compile.regather_choice import device_memory, gib, memory_refusal
from stepbundle.runtime.compile.rewrites import regather_weights
from stepbundle.runtime.compile.stage import RewriteContext, Stage
from stepbundle.runtime.placement.layout_spec import parse_layout
from stepbundle.runtime.placement.shard_plan import plan_shards
from stepbundle.runtime.placement.sharding import Placement
from stepbundle.schema import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.artifact import parse_artifact
from stepbundle.stablehlo.regather import count_regathers, rewrite_regathers

# One linear layer under autocast: the weight %w converted to bf16 once, read by the
# forward product (x @ w^T), and through the transpose of that transpose by the backward's
# input-gradient product (dy @ w); the weight-gradient product reads no weight.
LINEAR = """
func.func @main(%w: tensor<8x4xf32>, %x: tensor<16x4xf32>, %dy: tensor<16x8xf32>)
    -> (tensor<16x8xf32>, tensor<16x4xf32>, tensor<8x4xf32>) {
  %wb = stablehlo.convert %w : (tensor<8x4xf32>) -> tensor<8x4xbf16>
  %wt = stablehlo.transpose %wb, dims = [1, 0] : (tensor<8x4xbf16>) -> tensor<4x8xbf16>
  %xb = stablehlo.convert %x : (tensor<16x4xf32>) -> tensor<16x4xbf16>
  %y = stablehlo.dot_general %xb, %wt, contracting_dims = [1] x [0] : (tensor<16x4xbf16>, tensor<4x8xbf16>) -> tensor<16x8xf32>
  %dyb = stablehlo.convert %dy : (tensor<16x8xf32>) -> tensor<16x8xbf16>
  %wtt = stablehlo.transpose %wt, dims = [1, 0] : (tensor<4x8xbf16>) -> tensor<8x4xbf16>
  %dx = stablehlo.dot_general %dyb, %wtt, contracting_dims = [1] x [0] : (tensor<16x8xbf16>, tensor<8x4xbf16>) -> tensor<16x4xf32>
  %dyt = stablehlo.transpose %dyb, dims = [1, 0] : (tensor<16x8xbf16>) -> tensor<8x16xbf16>
  %dw = stablehlo.dot_general %dyt, %xb, contracting_dims = [1] x [0] : (tensor<8x16xbf16>, tensor<16x4xbf16>) -> tensor<8x4xf32>
  return %y, %dx, %dw : tensor<16x8xf32>, tensor<16x4xf32>, tensor<8x4xf32>
}
"""

GPT = Path(__file__).resolve().parent / "data" / "tiny_gpt.stepbundle"
BARRIER, DOT = "stablehlo.optimization_barrier", "stablehlo.dot_general"


def _module() -> mlir.Module:
    return mlir.Module.parse_text(golden_train_module("linear_adamw"), LINEAR)


def _path(value: Any) -> list[str]:
    """What ``value`` is made of: the operations from it back to an argument or a
    barrier, nearest first (a barrier's result: ``barrier#N``)."""
    out = []
    while not isinstance(value.owner, ir.Block):
        op = value.owner.operation
        if op.name == BARRIER:
            return [*out, f"barrier#{ir.OpResult(value).result_number}"]
        out.append(op.name.removeprefix("stablehlo."))
        value = op.operands[0]
    return [*out, f"arg{ir.BlockArgument(value).arg_number}"]


def _ops(module: mlir.Module, name: str) -> list[Any]:
    with module._ctx:
        body = module.main.regions[0].blocks[0].operations  # in program order
        return [op.operation for op in body if op.operation.name == name]


def test_the_backward_product_reads_its_own_copy_behind_a_barrier() -> None:
    module = _module()
    assert count_regathers(module, [0]) == 1  # %dx: the second product of %w
    assert count_regathers(module, []) == 0
    assert rewrite_regathers(module, [0]) == 1
    with module._ctx:
        (barrier,) = _ops(module, BARRIER)
        # the barrier holds the parameter itself, tied to the incoming gradient
        assert _path(barrier.operands[0]) == ["arg0"]
        assert _path(barrier.operands[1]) == ["convert", "arg2"]
        forward, backward, weight_grad = _ops(module, DOT)
        # the forward product reads the weight as before; the backward one a copy of
        # the same chain (convert, transpose, transpose) from the barrier, and its
        # incoming gradient from the barrier too
        assert _path(forward.operands[1]) == ["transpose", "convert", "arg0"]
        assert _path(backward.operands[1]) == ["transpose", "transpose", "convert", "barrier#0"]
        assert _path(backward.operands[0]) == ["barrier#1"]
        assert _path(weight_grad.operands[0]) == ["transpose", "convert", "arg2"]
    assert rewrite_regathers(module, [0]) == 0  # a second pass adds nothing
    assert sum(1 for op in module._operations() if op.name == BARRIER) == 1


def test_the_values_are_the_same_bits() -> None:
    rng = np.random.default_rng(3)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((8, 4), (16, 4), (16, 8))]
    before = run_on_cpu(_module(), *args)
    module = _module()
    assert rewrite_regathers(module, [0]) == 1
    after = run_on_cpu(module, *args)
    assert len(after) == 3
    for a, b in zip(before, after):
        assert a.dtype == b.dtype == np.float32
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    w, x, dy = (a.astype(np.float64) for a in args)
    np.testing.assert_allclose(before[1], dy @ w, rtol=2e-2, atol=5e-2)  # bf16 operands


def _rewritten(layout: str, devices: int, regather: bool = True) -> tuple[int, dict[str, int]]:
    """The barriers in the GPT's train program after the rewrite, and its notes."""
    with open_bundle(GPT) as b:
        program = b.manifest.entries["train"].programs[0]
        module = parse_artifact(bytes(b.section(program.section)))
        plan = plan_shards(b.manifest, parse_layout(layout), devices)
    placement = Placement(jax.devices("cpu")[:devices], plan)
    ctx = RewriteContext("cpu", placement, regather_weights=regather)
    stage = regather_weights(Stage(module, program), ctx)
    return sum(1 for op in stage.module._operations() if op.name == BARRIER), ctx.notes


def _barriers_after(layout: str, devices: int) -> int:
    return _rewritten(layout, devices)[0]


@pytest.mark.parametrize(
    "layout, devices, applies",
    [
        ("fsdp", 4, True),
        ("fsdp+tp", 4, True),
        ("fsdp", 1, False),  # nothing is split on one device
        ("dp", 4, False),
        ("zero1", 4, False),  # the parameters stay whole
    ],
)
def test_only_layouts_that_split_parameters_over_data_are_rewritten(
    layout: str, devices: int, applies: bool
) -> None:
    n = _barriers_after(layout, devices)
    # the two blocks' four weights, and the head's, each read again by the backward
    assert (n >= 9) if applies else n == 0, (layout, n)


@pytest.mark.parametrize("layout", ["fsdp", "fsdp+tp"])
def test_without_the_rewrite_the_products_it_would_copy_are_counted(layout: str) -> None:
    """``regather_weights=False`` keeps the program as written and notes how many products
    the rewrite would give a copy: ``compile_program``'s "auto" compiles the rewritten
    program only where there are some."""
    barriers, notes = _rewritten(layout, 4, regather=False)
    assert barriers == 0 and "regathered_products" not in notes
    _, done = _rewritten(layout, 4)
    assert notes["regather_sites"] == done["regathered_products"] >= 9
    assert _rewritten("zero1", 4, regather=False)[1] == {}  # nothing it would rewrite


# libtpu's refusals as it wrote them: the 8B's fsdp program for a v5e-256 before the
# rewrite (benchmarks/results/parallel_offline-v5e.json as of e719f49, its libtpu_report),
# and the same program with every layer checkpointed (the compile's log).
HBM_REFUSAL = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
    "hbm. Used 16.22G of 15.75G hbm. Exceeded hbm capacity by 482.50M. Memory usage report: "
    "\n\nMemory Space: default (color=0)\nTotal bytes: 17416729600 (16.22GiB)\n"
)
TEMPORARIES_REFUSAL = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (16.20G) exceeds available HBM (15.75G)."
)


def test_a_compile_refused_for_memory_is_told_from_other_failures() -> None:
    said = memory_refusal(_compat.JaxRuntimeError(HBM_REFUSAL))
    assert said == (
        "XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used "
        "16.22G of 15.75G hbm. Exceeded hbm capacity by 482.50M."
    )  # without the buffer listing
    said = memory_refusal(_compat.JaxRuntimeError(TEMPORARIES_REFUSAL))
    assert said is not None and said.startswith("Ran out of memory on HBM")
    assert memory_refusal(_compat.JaxRuntimeError("INVALID_ARGUMENT: bad sharding")) is None
    assert memory_refusal(ValueError(TEMPORARIES_REFUSAL)) is None  # not the compiler's


def test_a_cpu_reports_no_memory_to_weigh_a_program_against() -> None:
    assert device_memory(jax.devices("cpu")[:4]) is None
    assert gib(16_911_433_728) == "15.75 GiB" and gib(125_648) == "125,648 bytes"
