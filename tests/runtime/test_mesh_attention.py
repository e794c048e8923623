"""The fused attention kernels under a device mesh (runtime/compile/mesh_attention.py).

``data/sdpa_mesh.stepbundle`` (``data/make_sdpa_mesh.py``) is a one-block GPT whose only
bf16 operation is its ``F.scaled_dot_product_attention``, written by the torch front-end
as an attention composite. On the CPU the runtime fuses nothing, so the tests force the
TPU's rewrite with the kernels interpreted (as the one-device composite tests do) and
hold each layout's run to the one-device fused run at the data-parallel bounds
(test_layouts.py): the kernels compute each sequence and head on its own, so splitting
them over devices changes only where the float32 sums outside them are added. The
program lowered for a TPU (no chip needed) shows the one kernel call per shard.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from stepbundle.runtime import LoadOptions, load
from stepbundle.runtime.compile import rewrites
from stepbundle.runtime.placement.layout_spec import parse_layout
from stepbundle.runtime.placement.shard_plan import plan_shards
from stepbundle.runtime.placement.sharding import MESH, Placement
from stepbundle.schema import open_bundle
from stepbundle.stablehlo import artifact as mlir

HERE = Path(__file__).resolve().parent
BUNDLE = HERE / "data" / "sdpa_mesh.stepbundle"
BATCH, HEADS, T, D = 8, 2, 128, 64
TOL = 1e-5  # test_layouts.py's data-parallel bounds
STEPS = 2


@contextlib.contextmanager
def forced_kernels() -> Iterator[None]:
    """Loads inside run the TPU's fused-attention rewrite on the CPU, kernels interpreted."""

    def forced(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        return rewrites.fuse_attention(stage, ctx, "cpu", interpret=True)

    original = rewrites.REWRITES
    rewrites.REWRITES = tuple((n, forced if n == "fused-attention" else r) for n, r in original)
    try:
        yield
    finally:
        rewrites.REWRITES = original


def square_buffers(trainer: Any, batch: dict[str, np.ndarray]) -> list[str]:
    """The shapes of the compiled train program's buffers that end in (T, T), per device."""
    plan, _ = trainer._dispatcher.pick("train", batch)
    hlo = plan.executable.hlo_modules()[0].to_string()
    return sorted(set(re.findall(rf"[a-z]+[0-9]*\[[0-9,]*,{T},{T}\]", hlo)))


def _batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {k: rng.integers(0, 64, (BATCH, T)).astype(np.int64) for k in ("idx", "y")}
        for _ in range(STEPS)
    ]


def _run(**kw: Any) -> tuple[Any, np.ndarray]:
    with forced_kernels():
        trainer = load(BUNDLE, options=LoadOptions.from_keywords(cache_dir=False, **kw))
    losses = np.array([float(m["loss"]) for m in trainer.run(_batches(), STEPS)])
    return trainer, losses


def _normwise(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a64 - b64) / max(float(np.linalg.norm(b64)), 1e-6))


def _assert_close(state: dict, losses: np.ndarray, ref: tuple[dict, np.ndarray]) -> None:
    ref_state, ref_losses = ref
    assert np.abs(losses - ref_losses).max() <= TOL * np.abs(ref_losses).max(), losses
    assert set(state) == set(ref_state)
    for k, v in ref_state.items():
        assert _normwise(state[k], v) <= TOL, (k, _normwise(state[k], v))


def _global_square(shapes: list[str]) -> list[str]:
    """Those of ``shapes`` that hold the whole global batch's (T, T) scores."""
    return [s for s in shapes if re.search(rf"\[({BATCH}|{BATCH * HEADS}),", s)]


@pytest.fixture(scope="module")
def one_device() -> tuple[dict[str, np.ndarray], np.ndarray]:
    trainer, losses = _run()
    assert trainer.load_info.fused_attention == {"train[0]": 1}
    assert losses[0] != losses[-1]  # it trains
    return trainer.state_dict(), losses


@pytest.mark.parametrize("layout", ["dp", "fsdp+tp"])
def test_four_devices_with_the_kernels_match_one_device(layout: str, one_device: Any) -> None:
    trainer, losses = _run(devices=4, layout=layout)
    assert trainer.load_info.fused_attention == {"train[0]": 1}
    assert trainer.load_info.attention_kept == {}
    _assert_close(trainer.state_dict(), losses, one_device)
    # No buffer of the global batch's scores: each device's kernel holds its own rows.
    shapes = square_buffers(trainer, _batches()[0])
    assert shapes and not _global_square(shapes), shapes


def test_eight_devices_with_the_kernels_match_one_device(one_device: Any, tmp_path: Path) -> None:
    """8 virtual devices (a child process: this one has 4): fsdp over 8, one sequence
    per device."""
    batches = _batches()
    np.savez(tmp_path / "batches.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    r = subprocess.run(
        [sys.executable, str(HERE / "mesh_attention_child.py"), str(BUNDLE)]
        + [str(tmp_path / "batches.npz"), str(STEPS), str(tmp_path), "fsdp"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(tmp_path / "fsdp.npz") as z:
        state = {k.removeprefix("state."): z[k] for k in z.files if k.startswith("state.")}
        assert int(z["fused"]) == 1
        shapes = [str(s) for s in z["tt_shapes"]]
        assert shapes and not _global_square(shapes), shapes
        _assert_close(state, z["losses"], one_device)


def _tpu_rewrite(layout: str) -> tuple[rewrites.Stage, rewrites.RewriteContext, str]:
    """The train program rewritten for a TPU over 4 devices in ``layout`` (lowered, not
    compiled: no chip needed), and its text after the mesh annotations."""
    with open_bundle(BUNDLE) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
        plan = plan_shards(b.manifest, parse_layout(layout), 4)
    ctx = rewrites.RewriteContext(platform="tpu", placement=Placement(jax.devices()[:4], plan))
    stage = rewrites.Stage(module, program)
    out = rewrites.fuse_attention(stage, ctx, "tpu")
    text = rewrites.aliasing_and_sharding(out, ctx).module.text()
    return out, ctx, text


@pytest.mark.parametrize(
    "layout, split, local",
    [
        ("fsdp", '[{"data"}, {}, {}, {}]', (2, 2)),
        ("fsdp+tp", '[{"data"}, {"model"}, {}, {}]', (4, 1)),
    ],
)
def test_the_tpu_program_calls_the_kernel_on_each_shard(
    layout: str, split: str, local: tuple[int, int]
) -> None:
    _, ctx, text = _tpu_rewrite(layout)
    assert ctx.notes["fused_attention"] == 1 and ctx.kept_attention == []
    assert "stablehlo.composite" not in text
    # One mesh, the program's: the kernels' own was folded into it.
    assert re.findall(r"sdy\.mesh @(\w+)", text) == [MESH]
    # The forward and the backward kernels, each under a manual computation that splits
    # q (B, H, T, D) over the mesh and runs the Mosaic kernel on its shard's rows/heads.
    manual = re.findall(r"sdy\.manual_computation\(.*?in_shardings=\[(.*?)\] out_shardings", text)
    assert len(manual) == 2 and all(f"<@{MESH}, {split}>" in m for m in manual), manual
    b, h = local
    assert f"tensor<{b}x{h}x{T}x{D}xbf16>" in text
    assert "tpu_custom_call" in text


def test_at_highest_precision_a_tpu_keeps_attention_and_says_why() -> None:
    """A TPU at matmul precision 'highest' (what a torch front-end bundle records) keeps
    the attention traced: the load says so and how to fuse it, where a new user found
    0 fused, nothing kept and no word (the same program at 'default' fuses it)."""
    with open_bundle(BUNDLE) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
    for precision, fused in (("highest", False), ("default", True)):
        ctx = rewrites.RewriteContext(
            platform="tpu", placement=Placement(jax.devices()[:1]), matmul_precision=precision
        )
        out = rewrites.fused_attention(rewrites.Stage(module, program), ctx)
        assert ("tpu_custom_call" in out.module.text()) is fused, precision
        if fused:
            assert ctx.kept_attention == [] and ctx.notes["fused_attention"] == 1
        else:
            assert out is not None and len(ctx.kept_attention) == 1, ctx.kept_attention
            assert "matmul precision is 'highest'" in ctx.kept_attention[0]
            assert "--matmul-precision default" in ctx.kept_attention[0]


def test_heads_that_do_not_split_keep_the_decomposition_and_say_why() -> None:
    # fsdp+tp:4 on 4 devices: a model axis of 4 over the 2 heads
    out, ctx, text = _tpu_rewrite("fsdp+tp:4")
    assert ctx.notes["fused_attention"] == 0
    assert "stablehlo.composite" in text and "tpu_custom_call" not in text
    assert len(ctx.kept_attention) == 2  # the forward and the backward
    assert all("do not split over the 4 devices of the model axis" in k for k in ctx.kept_attention)
