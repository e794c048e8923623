"""Parallel layouts (#41): ZeRO-1, FSDP and tensor parallelism from the same one-device
bundle, on 4 virtual CPU devices here and on 8 in a child process.

The bundle is a two-block GPT with nanoGPT's parameter names and AdamW
(``data/tiny_gpt.stepbundle``, made by ``data/make_tiny_gpt.py``). Each layout's losses
and final state must equal the one-device run's within the data-parallel bounds
(test_data_parallel.py): 1e-5 of each tensor's own scale. Splitting the state changes
only where sums are added (the partitioner's gathers and reduce-scatters), never what is
computed: a shard updated from the wrong slice, a missing gather or a model-axis split
of the wrong dimension moves the numbers by orders of magnitude more.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_helpers import golden_batches, golden_bundle, rel

from stepbundle.runtime import (
    CompileOptions,
    LoadOptions,
    ParallelOptions,
    UsageError,
    _compat,
    load,
)
from stepbundle.runtime.compile.regather_choice import memory_need
from stepbundle.runtime.placement.layout_spec import (
    DataSplit,
    LayoutError,
    ParallelLayout,
    ShardRule,
    parse_layout,
)
from stepbundle.runtime.placement.shard_plan import plan_shards
from stepbundle.runtime.state.checkpoint import read_safetensors, write_safetensors
from stepbundle.runtime.state.named import StreamedState
from stepbundle.schema import open_bundle
from stepbundle.schema.manifest import StateKind
from stepbundle.stablehlo.artifact import parse_artifact
from stepbundle.stablehlo.lookups import lookup_dims

HERE = Path(__file__).resolve().parent
GPT = HERE / "data" / "tiny_gpt.stepbundle"
TOL = 1e-5
STEPS = 4


def _gpt_batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "idx": rng.integers(0, 32, (8, 8)).astype(np.int64),
            "y": rng.integers(0, 32, (8, 8)).astype(np.int64),
        }
        for _ in range(3)
    ]


def _run(path: Path, batches: list[dict[str, np.ndarray]], **kw: Any) -> tuple[Any, np.ndarray]:
    trainer = load(path, options=LoadOptions.from_keywords(cache_dir=False, **kw))
    losses = np.array([float(m["loss"]) for m in trainer.run(batches, STEPS)])
    return trainer, losses


def _normwise(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a64 - b64) / max(float(np.linalg.norm(b64)), 1e-6))


def _assert_close(state: dict, ref: dict, losses: np.ndarray, ref_losses: np.ndarray) -> None:
    """docs/parallel.md's data-parallel bounds: losses 1e-5 relative, state 1e-5
    normwise (Adam's second moment 2e-5)."""
    assert rel(losses, ref_losses) <= TOL, (losses, ref_losses)
    assert set(state) == set(ref)
    for k, v in ref.items():
        assert state[k].dtype == v.dtype and state[k].shape == v.shape, k
        bound = 2 * TOL if k.endswith("exp_avg_sq") else TOL
        assert _normwise(state[k], v) <= bound, (k, _normwise(state[k], v))


@pytest.fixture(scope="module")
def one_device() -> tuple[dict[str, np.ndarray], np.ndarray]:
    trainer, losses = _run(GPT, _gpt_batches())
    assert losses[0] != losses[-1]  # it trains
    return trainer.state_dict(), losses


@pytest.fixture(scope="module")
def layouts_on_four() -> dict[str, tuple[Any, np.ndarray]]:
    """The GPT run on 4 devices in each layout (one compile each, shared by the tests)."""
    return {
        layout: _run(GPT, _gpt_batches(), devices=4, layout=layout)
        for layout in ("zero1", "fsdp", "fsdp+tp")
    }


@pytest.mark.parametrize("layout", ["zero1", "fsdp", "fsdp+tp"])
def test_each_layout_on_four_devices_matches_one_device(
    layout: str, one_device: Any, layouts_on_four: Any
) -> None:
    ref_state, ref_losses = one_device
    trainer, losses = layouts_on_four[layout]
    assert trainer.load_info.layout == parse_layout(layout).spec
    _assert_close(trainer.state_dict(), ref_state, losses, ref_losses)


def test_fsdp_splits_parameters_and_optimizer_state_over_the_data_axis(
    layouts_on_four: Any,
) -> None:
    trainer, _ = layouts_on_four["fsdp"]
    manifest = trainer.manifest
    buffers = dict(zip(trainer._store.layout.buffer_names, trainer._store.buffers))
    w = "transformer.h.0.mlp.c_fc.weight"  # [64, 16]: split on its first dimension
    for name in (w, f"optimizer.state.{w}.exp_avg", f"optimizer.state.{w}.exp_avg_sq"):
        shards = buffers[name].addressable_shards
        assert sorted(s.data.shape for s in shards) == [(16, 16)] * 4, name
    # Every parameter and moment whose dimension divides is split, none is replicated.
    split = trainer.placement.state_dims
    for s in manifest.state:
        if s.kind in (StateKind.PARAMETER, StateKind.OPTIMIZER_STATE) and s.spec.shape:
            assert s.name in split, s.name
    # The partitioner gathers the split parameters where the step reads them.
    plan, _ = trainer._dispatcher.pick("train", _gpt_batches()[0])
    hlo = plan.executable.hlo_modules()[0].to_string()
    assert "all-gather" in hlo


def _collectives(hlo: str) -> list[tuple[str, str, str, str]]:
    """(element type, dimensions, kind, the source operation's name) of each collective."""
    return re.findall(
        r"=\s+([a-z]+[0-9]*)\[([0-9,]*)\]\S*\s+(all-gather|all-reduce|reduce-scatter)"
        r"(?:-start)?\(.*?op_name=\"([^\"]*)\"",
        hlo,
    )


def test_fsdp_looks_rows_up_where_the_table_lives(layouts_on_four: Any) -> None:
    """#41: with the embeddings split on the rows their lookups index, the partitioner
    gathered each whole float table onto every device for the lookup and all-reduced its
    whole gradient (a scatter into a table of zeros): on a v5e-256, 1.96 GiB each for an
    8B's 128,256 x 4,096 embedding. A table the program looks up is now split on its
    width: the token ids are gathered instead, and the table and its gradient stay split."""
    trainer, _ = layouts_on_four["fsdp"]
    dims = trainer.placement.state_dims
    for table in ("transformer.wte.weight", "transformer.wpe.weight"):
        for name in (
            table,
            f"optimizer.state.{table}.exp_avg",
            f"optimizer.state.{table}.exp_avg_sq",
        ):
            assert dims[name] == (None, "data"), name
    assert dims["lm_head.weight"] == ("data", None)  # a product's weight: its rows, as before
    plan, _ = trainer._dispatcher.pick("train", _gpt_batches()[0])
    found = _collectives(plan.executable.hlo_modules()[0].to_string())
    lookups = [(k, t, d) for t, d, k, op in found if op.startswith(("gather", "scatter"))]
    # The lookups' collectives are there, named by their operation (so the next line
    # reads something): the token ids, s32[8, 8, 1], gathered for the lookup and its
    # gradient.
    assert ("all-gather", "s32", "8,8,1") in lookups, lookups
    floats = [c for c in lookups if c[1].startswith(("f", "bf")) and c[2] in ("32,16", "8,16")]
    assert not floats, floats  # no whole table (wte [32, 16], wpe [8, 16]) moved


@pytest.mark.parametrize("layout", ["fsdp", "fsdp+tp"])
def test_regathering_the_weights_for_the_backward_changes_no_bit(
    layout: str, layouts_on_four: Any
) -> None:
    """#41: under a layout that splits the parameters over the data axis, each product
    of a parameter after its first may read its own copy behind a barrier (the
    ``regather-weights`` rewrite, ``tests/runtime/test_regather.py``), so that the
    partitioner gathers the weight again for the backward pass. ``regather_weights=True``
    always does, False never; "auto" (the default) compiles the program as written and
    the rewritten one too only where the first does not fit the device: on the CPU,
    which reports no memory, where ``device_memory`` is below XLA's plan of the program
    as written. A barrier is the identity: every run ends on the same bits."""
    as_written, losses = layouts_on_four[layout]  # "auto", no memory figure: as written
    info = as_written.load_info
    assert info.regathered_products == {}
    assert "compiled as written" in info.regather_choice["train[0]"]
    assert "report no memory" in info.regather_choice["train[0]"]
    plan, _ = as_written._dispatcher.pick("train", _gpt_batches()[0])
    need = memory_need(plan.executable)
    assert need is not None and need > 0
    runs = {
        "forced": _run(GPT, _gpt_batches(), devices=4, layout=layout, regather_weights=True),
        "never": _run(GPT, _gpt_batches(), devices=4, layout=layout, regather_weights=False),
        # a device one byte short of the plan: both compiled, the rewritten one kept (its
        # plan here is no larger); its 2-step program follows it, without a second weighing
        "squeezed": _run(
            GPT, _gpt_batches(), devices=4, layout=layout, device_memory=need - 1, steps_per_call=2
        ),
    }
    assert runs["forced"][0].load_info.regathered_products["train[0]"] > 0
    assert runs["forced"][0].load_info.regather_choice == {}  # asked, not weighed
    assert runs["never"][0].load_info.regathered_products == {}
    squeezed = runs["squeezed"][0].load_info
    assert squeezed.regathered_products == runs["forced"][0].load_info.regathered_products
    assert f"over the {need - 1:,} bytes a device holds" in squeezed.regather_choice["train[0]"]
    assert squeezed.regather_choice["train[0]"].endswith("compiled with them")
    assert set(squeezed.cache) == {"train[0]", "train[0]+regather-weights", "train[0]x2"}
    state = as_written.state_dict()
    for trainer, run_losses in runs.values():
        assert np.array_equal(run_losses, losses)
        other = trainer.state_dict()
        for k, v in state.items():
            assert np.array_equal(other[k], v), k


def test_a_device_with_room_keeps_the_program_as_written() -> None:
    """``regather_weights="auto"`` with ``device_memory`` at XLA's plan of the program
    as written: it fits, and only it is compiled."""
    trainer, _ = _run(GPT, _gpt_batches()[:1], devices=4, layout="fsdp", regather_weights=False)
    plan, _ = trainer._dispatcher.pick("train", _gpt_batches()[0])
    need = memory_need(plan.executable)
    assert need is not None
    roomy = load(
        GPT,
        options=LoadOptions.from_keywords(
            cache_dir=False, devices=4, layout="fsdp", device_memory=need, compile_only=True
        ),
    ).load_info
    assert roomy.regathered_products == {}
    assert set(roomy.cache) == {"train[0]"}
    assert f"within the {need:,} bytes a device holds" in roomy.regather_choice["train[0]"]


def test_tensor_parallel_follows_megatrons_split(layouts_on_four: Any) -> None:
    trainer, _ = layouts_on_four["fsdp+tp"]
    assert trainer.load_info.mesh == {"data": 2, "model": 2}
    dims = trainer.placement.state_dims
    h = "transformer.h.0."
    # Column split on the way in, row split on the way out, the vocabulary of the
    # embedding; FSDP takes the other dimension over the data axis.
    assert dims[h + "attn.c_attn.weight"] == ("model", "data")
    assert dims[h + "mlp.c_fc.weight"] == ("model", "data")
    assert dims[h + "mlp.c_fc.bias"] == ("model",)
    assert dims[h + "attn.c_proj.weight"] == ("data", "model")
    assert dims[h + "mlp.c_proj.weight"] == ("data", "model")
    assert dims[h + "mlp.c_proj.bias"] == ("data",)  # a row split's bias stays whole on model
    assert dims["transformer.wte.weight"] == ("model", "data")
    assert dims["lm_head.weight"] == ("model", "data")
    # Adam's moments follow their parameter.
    assert dims[f"optimizer.state.{h}mlp.c_fc.weight.exp_avg"] == ("model", "data")
    buffers = dict(zip(trainer._store.layout.buffer_names, trainer._store.buffers))
    shards = buffers[h + "mlp.c_fc.weight"].addressable_shards  # [64, 16] over 2 x 2
    assert sorted(s.data.shape for s in shards) == [(32, 8)] * 4


def test_tensor_parallel_keeps_the_batch_split_over_the_data_axis(layouts_on_four: Any) -> None:
    """#41: with one priority for the batch's and the weights' splits, the partitioner
    met them on the products and gathered the activations over ``data`` instead of the
    weights: every device held all 8 sequences inside attention (``f32[8,4,8,4]`` on
    this CPU, the global batch on a TPU slice). The batch's split now propagates first,
    so each device's activations are its data group's 4 sequences and what is gathered
    is weights (rank 2 at most)."""
    trainer, _ = layouts_on_four["fsdp+tp"]
    rows = _gpt_batches()[0]["idx"].shape[0]  # 8, over a data axis of 2
    plan, _ = trainer._dispatcher.pick("train", _gpt_batches()[0])
    hlo = plan.executable.hlo_modules()[0].to_string()
    gathered = re.findall(r"=\s+([a-z]+[0-9]*)\[([0-9,]+)\]\S*\s+all-gather(?:-start)?\(", hlo)
    assert gathered  # the weights split over data are gathered
    # (the token ids, s32[8, 8, 1], are gathered whole for the embedding's lookup)
    whole_batch = [
        (t, d)
        for t, d in gathered
        if t.startswith(("f", "bf")) and d.count(",") >= 2 and int(d.split(",")[0]) == rows
    ]
    assert not whole_batch, whole_batch


def test_state_bytes_per_device_shrink_with_each_layout(layouts_on_four: Any) -> None:
    nbytes = {k: t.load_info.state_bytes_per_device for k, (t, _) in layouts_on_four.items()}
    for k, (t, _) in layouts_on_four.items():
        per_device = t.state_bytes_per_device()
        assert len(per_device) == 4 and max(per_device.values()) == nbytes[k], k
    total = sum(s.spec.nbytes for s in _gpt_manifest().state)  # what dp holds per device
    # AdamW's moments are 2/3 of the state: ZeRO-1 keeps a quarter of them.
    assert nbytes["zero1"] < 0.55 * total
    # FSDP splits nearly everything; only the scalar step counts stay whole.
    assert nbytes["fsdp"] < 0.26 * total
    assert nbytes["fsdp+tp"] < 0.27 * total


def test_checkpoint_of_a_sharded_run_is_the_whole_state(
    layouts_on_four: Any, tmp_path: Path
) -> None:
    trainer, _ = layouts_on_four["fsdp+tp"]
    trainer.save_checkpoint(tmp_path / "tp.safetensors")
    values, _ = read_safetensors(tmp_path / "tp.safetensors")
    state = trainer.state_dict()
    for k, v in state.items():
        np.testing.assert_array_equal(values[k], v, err_msg=k)
    one = load(GPT, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    one.load_checkpoint(tmp_path / "tp.safetensors")
    assert one.step_count == trainer.step_count
    for k, v in one.state_dict().items():
        np.testing.assert_array_equal(v, state[k], err_msg=k)


def test_a_checkpoint_holds_one_tensor_on_the_host_at_a_time(
    layouts_on_four: Any, tmp_path: Path
) -> None:
    """#41 item 3: the state streams from the devices into the file tensor by tensor
    (each split tensor gathered on its own), twice (the digest, then the bytes), and the
    file is the one the whole state_dict gives."""
    trainer, _ = layouts_on_four["fsdp+tp"]
    store = trainer._store
    alive: list[weakref.ref] = []
    most = 0

    def to_host(buf: Any) -> np.ndarray:
        nonlocal most
        a = _compat.to_host_uncached(buf)
        alive[:] = [r for r in alive if r() is not None] + [weakref.ref(a)]
        most = max(most, len(alive))
        return a

    streamed = StreamedState(trainer.manifest, store.layout, list(store.buffers), to_host)
    write_safetensors(tmp_path / "streamed.safetensors", streamed, {"k": "v"}, streamed.specs)
    write_safetensors(tmp_path / "whole.safetensors", trainer.state_dict(), {"k": "v"})
    assert (tmp_path / "streamed.safetensors").read_bytes() == (
        tmp_path / "whole.safetensors"
    ).read_bytes()
    # Each pack of small tensors is copied once and kept; every other tensor is dropped
    # before the next is read.
    assert most <= 1 + len(store.layout.packs), most
    # jax keeps no host copy on the buffers either (it would hold the whole state).
    assert all(getattr(b, "_npy_value", None) is None for b in store.buffers)


def test_a_restore_copies_no_tensor_out_of_the_file(
    layouts_on_four: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#41 item 3, the other way: ``load_checkpoint`` hands each tensor held on its own
    to the devices as a view of the mapped file (read-only, owning nothing: no copy of
    it is made on the host), so a process of a job reads only its devices' pieces; only
    the packs of small tensors are joined into new arrays."""
    trainer, _ = layouts_on_four["fsdp"]
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    state = trainer.state_dict()
    placement = trainer._store.placement
    handed: dict[str, tuple[bool, bool]] = {}
    put = placement.put_state

    def spy(name: str, a: np.ndarray) -> Any:
        handed[name] = (a.flags.owndata, a.flags.writeable)
        return put(name, a)

    monkeypatch.setattr(placement, "put_state", spy)
    trainer.load_checkpoint(tmp_path / "c.safetensors")
    packs = {p.name for p in trainer._store.layout.packs}
    alone = [n for n in trainer._store.layout.buffer_names if n not in packs]
    assert alone and set(handed) == set(trainer._store.layout.buffer_names)
    assert all(handed[n] == (False, False) for n in alone), handed
    assert all(handed[n][0] for n in packs), handed  # joined: new arrays
    for k, v in trainer.state_dict().items():
        np.testing.assert_array_equal(v, state[k], err_msg=k)


def test_eight_devices_fsdp_and_fsdp_tp_match_one_device(one_device: Any, tmp_path: Path) -> None:
    """8 virtual devices (a child process: this one has 4): fsdp over 8, and fsdp+tp
    as a 4 x 2 mesh."""
    batches = _gpt_batches()
    np.savez(tmp_path / "batches.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    layouts = ("fsdp", "fsdp+tp")
    r = subprocess.run(
        [sys.executable, str(HERE / "layouts_child.py"), str(GPT), str(tmp_path / "batches.npz")]
        + [str(STEPS), str(tmp_path), *layouts],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref_state, ref_losses = one_device
    total = sum(v.nbytes for v in ref_state.values())
    for layout in layouts:
        with np.load(tmp_path / f"{layout}.npz") as z:
            state = {k.removeprefix("state."): z[k] for k in z.files if k.startswith("state.")}
            _assert_close(state, ref_state, z["losses"], ref_losses)
            assert len(z["bytes"]) == 8
            assert z["bytes"].max() < 0.15 * total, (layout, z["bytes"], total)


def test_fsdp_bytes_are_the_state_split_over_the_devices() -> None:
    """On the golden dropout_sgd bundle (SGD with momentum, every tensor's first
    dimension divides by 4) each device holds exactly a quarter of the state."""
    name = "dropout_sgd"
    one, losses_one = _run(golden_bundle(name), golden_batches(name))
    four, losses_four = _run(golden_bundle(name), golden_batches(name), devices=4, layout="fsdp")
    _assert_close(four.state_dict(), one.state_dict(), losses_four, losses_one)
    total = sum(s.spec.nbytes for s in open_bundle(golden_bundle(name)).manifest.state)
    assert set(four.state_bytes_per_device().values()) == {total // 4}


# ------------------------------------------------------------------ specs and refusals
@pytest.mark.parametrize(
    "text, data, model",
    [
        ("dp", DataSplit.DP, 1),
        ("zero1", DataSplit.ZERO1, 1),
        ("FSDP", DataSplit.FSDP, 1),
        ("fsdp+tp", DataSplit.FSDP, 2),
        ("fsdp+tp:4", DataSplit.FSDP, 4),
        ("tp", DataSplit.DP, 2),
        ("tp:2+zero1", DataSplit.ZERO1, 2),
    ],
)
def test_layout_specs_parse(text: str, data: DataSplit, model: int) -> None:
    assert parse_layout(text) == ParallelLayout(data, model)


@pytest.mark.parametrize("text", ["", "ddp", "fsdp+zero1", "tp+tp", "fsdp+tp:0", "fsdp:2"])
def test_bad_layout_specs_are_refused_when_the_options_are_made(text: str) -> None:
    with pytest.raises(LayoutError, match="Use dp, zero1 or fsdp"):
        ParallelOptions(devices=4, layout=text)


def test_shard_optimizer_state_is_the_zero1_layout() -> None:
    assert ParallelOptions(devices=2, shard_optimizer_state=True).layout == "zero1"
    assert ParallelOptions(devices=2, layout="tp", shard_optimizer_state=True).layout == (
        "zero1+tp:2"
    )


def _gpt_manifest() -> Any:
    with open_bundle(GPT) as b:
        return b.manifest


def test_a_rule_that_does_not_divide_is_refused() -> None:
    rules = (ShardRule("mlp.c_fc.weight", 1),)  # [64, 16]: 16 over 3
    with pytest.raises(LayoutError, match=r"16 does not divide by 3") as err:
        plan_shards(_gpt_manifest(), ParallelLayout(DataSplit.FSDP, 3), 3, rules)
    assert isinstance(err.value, UsageError)  # the caller's choice to change
    assert "transformer.h.0.mlp.c_fc.weight" in str(err.value)


def test_a_rule_past_the_rank_or_matching_nothing_is_refused() -> None:
    layout = ParallelLayout(DataSplit.DP, 2)
    with pytest.raises(LayoutError, match="has shape \\[64\\] \\(1 dimension\\)"):
        plan_shards(_gpt_manifest(), layout, 2, (ShardRule("mlp.c_fc.bias", 1),))
    with pytest.raises(LayoutError, match="matches no parameter"):
        plan_shards(_gpt_manifest(), layout, 2, (ShardRule("q_proj.weight", 0),))
    with pytest.raises(LayoutError, match="a non-empty str"):
        ShardRule("", 0)


def test_default_rules_keep_what_does_not_divide_whole_and_say_so() -> None:
    plan = plan_shards(_gpt_manifest(), ParallelLayout(DataSplit.DP, 3), 3)
    # Nothing of this GPT divides by 3 except c_attn ([48, 16]).
    assert plan.dims["transformer.h.0.attn.c_attn.weight"] == ("model", None)
    assert "transformer.wte.weight" not in plan.dims
    assert any(n.startswith("transformer.wte.weight [32, 16] kept whole") for n in plan.notes)


def test_a_data_split_that_cannot_split_a_tensor_says_so() -> None:
    """fsdp over 3 devices: the tiny GPT's [32, 16] embedding has no dimension dividing
    by 3, so every device holds it whole, and the notes name it (a new user's model
    under fsdp on 8 devices held all its state on every device with no word)."""
    plan = plan_shards(_gpt_manifest(), ParallelLayout(DataSplit.FSDP), 3)
    assert "transformer.wte.weight" not in plan.dims
    note = [n for n in plan.notes if "kept whole on every device" in n]
    assert len(note) == 1 and "transformer.wte.weight [32, 16]" in note[0], plan.notes
    assert "no free dimension dividing by 3" in note[0]
    # zero1 takes only the optimizer state: the parameter itself is not named
    plan = plan_shards(_gpt_manifest(), ParallelLayout(DataSplit.ZERO1), 3)
    note = [n for n in plan.notes if "kept whole on every device" in n]
    assert note and "transformer.wte.weight [" not in note[0]
    assert "transformer.wte.weight.exp_avg" in note[0], note


def test_default_rules_split_the_blocks_people_write_as_megatron_does() -> None:
    """The first default rule a name matches: a block's projections into attention and
    the MLP on their outputs (0), the projections back on their inputs (1), across the
    naming of GPT-2, Llama and timm's ViT (whose attn.proj a new user found left whole
    beside a split attn.qkv); a projection back keeps its bias whole."""
    from stepbundle.runtime.placement.layout_spec import DEFAULT_TP_RULES

    def first(name: str) -> int | None:
        return next((r.dim for r in DEFAULT_TP_RULES if r.matches(name)), None)

    expect = {
        "blocks.0.attn.qkv.weight": 0,
        "blocks.0.attn.qkv.bias": 0,
        "blocks.0.attn.proj.weight": 1,
        "blocks.0.attn.proj.bias": None,
        "blocks.0.mlp.fc1.weight": 0,
        "blocks.0.mlp.fc1.bias": 0,
        "blocks.0.mlp.fc2.weight": 1,
        "blocks.0.mlp.fc2.bias": None,
        "transformer.h.0.attn.c_attn.weight": 0,
        "transformer.h.0.attn.c_proj.weight": 1,
        "model.layers.0.self_attn.o_proj.weight": 1,
        "model.layers.0.mlp.down_proj.weight": 1,
    }
    assert {n: first(n) for n in expect} == expect


def test_the_notes_say_what_tensor_parallelism_split_and_what_split_nothing() -> None:
    # A new user's model whose names no default rule knows loaded under fsdp+tp with
    # nothing split over the model axis and no word of it; rules under a layout without
    # a model axis, and a layout on one device, were dropped as silently.
    manifest = _gpt_manifest()
    plan = plan_shards(manifest, ParallelLayout(DataSplit.FSDP, 2), 4)
    split = sorted(n for n, d in plan.dims.items() if "model" in d and ".state." not in n)
    summary = [n for n in plan.notes if "split over the model axis" in n]
    assert len(summary) == 1 and summary[0].startswith(f"{len(split)} of "), plan.notes
    plan = plan_shards(manifest, ParallelLayout(DataSplit.FSDP, 2), 4, ())
    assert not any("model" in d for d in plan.dims.values())
    assert any(n.startswith("no parameter is split over the model axis") for n in plan.notes)
    plan = plan_shards(manifest, ParallelLayout(DataSplit.FSDP), 4, (ShardRule("c_fc.weight", 0),))
    assert any("has no model axis: they split nothing" in n for n in plan.notes), plan.notes
    plan = plan_shards(manifest, ParallelLayout(DataSplit.FSDP), 1)
    assert plan.dims == {} and any("on 1 device splits nothing" in n for n in plan.notes)
    assert not plan_shards(manifest, ParallelLayout(DataSplit.DP), 1).notes


def test_the_programs_lookups_are_found_and_steer_the_data_split() -> None:
    """``lookup_dims`` finds the GPT's two embedding lookups (through the private
    function the front-end wrote each in) on their rows; ``plan_shards`` then splits
    each table, and its moments, on the width, and where no other dimension divides it
    keeps the rows' split and says so."""
    with open_bundle(GPT) as b:
        program = b.manifest.entries["train"].programs[0]
        found = lookup_dims(parse_artifact(b.section(program.section)))
    names = {program.inputs[i].name: d for i, d in found.items()}  # type: ignore[union-attr]
    assert names == {
        "transformer.wte.weight": frozenset({0}),
        "transformer.wpe.weight": frozenset({0}),
    }
    manifest = _gpt_manifest()
    plan = plan_shards(manifest, ParallelLayout(DataSplit.FSDP), 4, lookups=names)
    assert plan.dims["transformer.wte.weight"] == (None, "data")
    assert plan.dims["optimizer.state.transformer.wte.weight.exp_avg_sq"] == (None, "data")
    assert plan.dims["lm_head.weight"] == ("data", None)
    assert not plan.notes
    # 16 columns over 32 devices do not divide, 32 rows do: the rows' split, noted.
    plan = plan_shards(manifest, ParallelLayout(DataSplit.FSDP), 32, lookups=names)
    assert plan.dims["transformer.wte.weight"] == ("data", None)
    assert any(n.startswith("transformer.wte.weight [32, 16] split over data on dimension 0")
               for n in plan.notes), plan.notes  # fmt: skip
    # Without lookups (or under zero1, which splits no parameter) nothing changes.
    plan = plan_shards(manifest, ParallelLayout(DataSplit.FSDP), 4)
    assert plan.dims["transformer.wte.weight"] == ("data", None)


def test_a_model_axis_that_does_not_divide_the_devices_is_refused_at_load() -> None:
    with pytest.raises(LayoutError, match="does not divide the 4 device"):
        load(
            GPT,
            options=LoadOptions(
                compile=CompileOptions(cache_dir=False),
                parallel=ParallelOptions(devices=4, layout="fsdp+tp:3"),
            ),
        )


def test_cli_run_takes_a_layout(tmp_path: Path) -> None:
    name = "dropout_sgd"
    data = str(golden_bundle(name).with_suffix("").with_suffix(".inputs.npz"))
    run = [sys.executable, "-m", "stepbundle", "run", str(golden_bundle(name)), "--no-cache"]
    r = subprocess.run(
        [*run, "--data", data, "--steps", "2", "--devices", "4", "--layout", "fsdp"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "on cpu x4 (layout fsdp, mesh data 4, 360 B of state per device)" in r.stderr
    # regather_weights="auto" weighed the program and the load says what it kept
    assert "[run] regather-weights: train[0]: compiled as written" in r.stderr, r.stderr
    # stepbundle compile says the same of the layout (it said nothing of it)
    compile_ = [sys.executable, "-m", "stepbundle", "compile", str(golden_bundle(name))]
    r = subprocess.run(
        [*compile_, "--cache-dir", str(tmp_path / "cache"), "--devices", "4", "--layout", "fsdp"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "for cpu x4 (layout fsdp, mesh data 4)" in r.stderr, r.stderr
    r = subprocess.run(
        [*run, "--data", data, "--steps", "2", "--devices", "4", "--layout", "fsdp+tp:3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "does not divide the 4 device" in r.stderr, r.stderr  # usage


def test_cli_takes_tensor_parallel_rules(tmp_path: Path) -> None:
    """--tp-rule PATTERN:DIM, in order, in place of the defaults ('defaults' puts them
    back): the load's notes say what the rules split; a rule that does not divide is a
    usage error; a malformed one is argparse's."""
    name = "dropout_sgd"  # fc1 [16, 6], fc2 [4, 16]: no name the default rules know
    data = str(golden_bundle(name).with_suffix("").with_suffix(".inputs.npz"))
    run = [sys.executable, "-m", "stepbundle", "run", str(golden_bundle(name)), "--no-cache"]
    run += ["--data", data, "--steps", "1", "--devices", "4", "--layout", "fsdp+tp"]

    def cli(*rules: str) -> subprocess.CompletedProcess[str]:
        extra = [a for r in rules for a in ("--tp-rule", r)]
        return subprocess.run([*run, *extra], capture_output=True, text=True, timeout=300)

    r = cli()
    assert r.returncode == 0 and "no parameter is split over the model axis" in r.stderr
    assert "--tp-rule PATTERN:DIM" in r.stderr, r.stderr  # the note says how to write rules
    r = cli("fc1.weight:0", "defaults", "fc2.weight:1")
    assert r.returncode == 0, r.stderr
    assert "2 of 4 parameters split over the model axis: fc1.weight:0, fc2.weight:1" in r.stderr
    r = cli("fc2.*:0")  # fc2.bias [4] divides by 2 too
    assert r.returncode == 0 and "2 of 4 parameters split over the model axis: " in r.stderr
    assert "fc2.weight:0, fc2.bias:0" in r.stderr or "fc2.bias:0, fc2.weight:0" in r.stderr, (
        r.stderr
    )
    r = cli("fc1.weight:1", "fc2.weight:1")  # fc1's 6 inputs split by 2; fc2's 16 too
    assert r.returncode == 0 and ": fc1.weight:1, fc2.weight:1" in r.stderr, r.stderr
    r = cli("fc1.weight:5")
    assert r.returncode == 2 and "fc1.weight" in r.stderr, r.stderr
    r = cli("fc1.weight")
    assert r.returncode == 2 and "expected PATTERN:DIM" in r.stderr, r.stderr


def test_cli_eval_takes_devices_and_a_layout() -> None:
    name = "linear_adamw"  # its eval entry's batch of 8 rows splits over 4 devices
    data = str(golden_bundle(name).with_suffix("").with_suffix(".inputs.npz"))
    ev = [sys.executable, "-m", "stepbundle", "eval", str(golden_bundle(name)), "--no-cache"]
    results, loads = [], []
    for extra in ([], ["--devices", "4", "--layout", "fsdp"]):
        r = subprocess.run(
            [*ev, "--data", data, "--json", *extra], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr
        results.append(json.loads(r.stdout))
        loads.append([line for line in r.stderr.splitlines() if line.startswith("[eval] loaded")])
    one, four = results
    # The load line, as run prints it: what was compiled, and the layout over 4 devices.
    assert len(loads[0]) == len(loads[1]) == 1, loads
    assert re.search(r" in [0-9.]+s \([1-9] compiled, 0 from cache\) on cpu$", loads[0][0]), loads
    assert " on cpu x4 (layout fsdp, mesh data 4, " in loads[1][0], loads
    assert one["rows"] == four["rows"] == 24
    assert abs(four["loss"] - one["loss"]) <= TOL * abs(one["loss"])
    # The layout reaches the load: a model axis that does not divide 4 devices is refused.
    r = subprocess.run(
        [*ev, "--data", data, "--devices", "4", "--layout", "tp:3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "does not divide the 4 device" in r.stderr, r.stderr  # usage
