"""Data-parallel runs: the same bundle over 2 and 4 virtual CPU devices, and over two
processes joined by jax.distributed.

Tolerance: a data-parallel step computes each device's partial sums over its slice of
the batch and then adds them across devices, so float32 sums are added in a different
order than on one device. Losses and every state tensor must agree with the
one-device run within 1e-5 of the tensor's scale (``rel``); measured differences are
below 2e-6. Anything else (a wrong shard, a missing all-reduce, a replica that stops
updating) moves them by orders of magnitude more.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from runtime_helpers import (
    GOLDEN_DIR,
    GOLDEN_SCHEDULES,
    GOLDEN_STEPS,
    golden_batches,
    golden_bundle,
    rel,
)

from stepbundle.runtime import (
    BindingError,
    CompileOptions,
    LoadOptions,
    NonFiniteLossError,
    ParallelOptions,
    PlatformError,
    SafetyOptions,
    StateOptions,
    UsageError,
    load,
)
from stepbundle.runtime.state.checkpoint import read_safetensors
from stepbundle.runtime.train.schedule import parse_schedule
from stepbundle.schema import open_bundle
from stepbundle.schema.manifest import StateKind

TOL = 1e-5
HERE = Path(__file__).resolve().parent


def _run(name: str, steps: int | None = None, **kw):
    trainer = load(golden_bundle(name), options=LoadOptions.from_keywords(**kw))
    if name in GOLDEN_SCHEDULES:
        trainer.set_schedule("lr", parse_schedule(GOLDEN_SCHEDULES[name]))
    metrics = trainer.run(golden_batches(name), steps or GOLDEN_STEPS[name])
    return trainer, np.array([float(m["loss"]) for m in metrics])


def _assert_close(state_a, state_b, losses_a=None, losses_b=None) -> None:
    if losses_a is not None:
        assert rel(losses_a, losses_b) <= TOL, (losses_a, losses_b)
    assert set(state_a) == set(state_b)
    for k in state_a:
        assert state_a[k].dtype == state_b[k].dtype and state_a[k].shape == state_b[k].shape, k
        assert rel(state_a[k], state_b[k]) <= TOL, (k, rel(state_a[k], state_b[k]))


def test_the_tests_have_four_cpu_devices() -> None:
    assert len(jax.devices("cpu")) >= 4, "tests/conftest.py sets jax_num_cpu_devices=4"


@pytest.mark.parametrize(
    "name, n, pack",
    [
        ("linear_adamw", 4, True),
        ("linear_adamw", 2, False),
        ("dropout_sgd", 4, True),
        ("batchnorm_lr", 2, True),
    ],
)
def test_data_parallel_run_matches_one_device(name: str, n: int, pack: bool) -> None:
    one, losses_one = _run(name, pack_state=pack)
    many, losses_many = _run(name, devices=n, pack_state=pack)
    assert len(many.devices) == n
    _assert_close(many.state_dict(), one.state_dict(), losses_many, losses_one)
    # The loss moved, so the replicas really applied their updates.
    assert losses_many[0] != losses_many[-1]
    # XLA partitioned the program: each device got its rows, and the partitioner
    # inserted the cross-device reduction itself.
    plan, dev = many._dispatcher.pick("train", golden_batches(name)[0])
    for k, a in dev.items():
        rows = a.shape[0]
        assert sorted(s.data.shape[0] for s in a.addressable_shards) == [rows // n] * n, k
    hlo = plan.executable.hlo_modules()[0].to_string()
    assert "all-reduce" in hlo


def test_dropout_masks_match_one_device_for_the_same_seed() -> None:
    """Random numbers are generated for the global batch, then split: the masks are the
    one-device masks, not N copies of one shard's."""
    one, losses_one = _run("dropout_sgd", steps=3)
    many, losses_many = _run("dropout_sgd", steps=3, devices=4)
    assert rel(losses_many, losses_one) <= TOL
    one.seed = many.seed = 99
    b = golden_batches("dropout_sgd")[0]
    assert abs(float(one.step(b)["loss"]) - float(many.step(b)["loss"])) <= TOL


def test_state_is_replicated_and_donated_on_every_device() -> None:
    t = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(
            state=StateOptions(pack_state=False),
            parallel=ParallelOptions(devices=4),
        ),
    )
    before = list(t._store.buffers)
    for a in before:
        assert len(a.addressable_shards) == 4 and a.is_fully_replicated
    t.step(golden_batches("linear_adamw")[0])
    t.block_until_ready()
    donated = [a.is_deleted() for a in before]
    # Every state tensor the step updates was donated (the rest are read-only).
    assert sum(donated) >= 6, donated
    assert all(a.is_fully_replicated for a in t._store.buffers)


def test_rejected_batch_donates_nothing_on_any_device() -> None:
    batches = golden_batches("linear_adamw")
    reference, _ = _run("linear_adamw", steps=2, devices=4)
    t = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(parallel=ParallelOptions(devices=4)),
    )
    t.step(batches[0])
    held = list(t._store.buffers)
    with pytest.raises(BindingError, match="Shape mismatch for batch input 'x'"):
        t.step({**batches[1], "x": batches[1]["x"][:4]})
    assert not any(a.is_deleted() for a in held)
    assert t.step_count == 1
    t.step(batches[1])
    for k, v in reference.state_dict().items():
        np.testing.assert_array_equal(t.state_dict()[k], v, err_msg=k)


def test_batch_already_split_over_the_devices_is_used_in_place() -> None:
    t = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(parallel=ParallelOptions(devices=4)),
    )
    ref = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(parallel=ParallelOptions(devices=4)),
    )
    batch = golden_batches("linear_adamw")[0]
    on_devices = {k: t.placement.put_batch(v) for k, v in batch.items()}
    _, dev = t._dispatcher.pick("train", on_devices)
    assert all(dev[k] is on_devices[k] for k in batch)
    assert float(t.step(on_devices)["loss"]) == float(ref.step(batch)["loss"])


def test_nonfinite_loss_stops_a_data_parallel_step_and_keeps_the_state() -> None:
    batches = golden_batches("linear_adamw")
    t = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(
            safety=SafetyOptions(stop_on_nonfinite=True),
            parallel=ParallelOptions(devices=4),
        ),
    )
    t.step(batches[0])
    before = t.state_dict()
    bad = {**batches[1], "x": np.full_like(batches[1]["x"], np.inf)}
    with pytest.raises(NonFiniteLossError):
        t.step(bad)
    assert t.step_count == 1
    for k, v in t.state_dict().items():
        assert v.tobytes() == before[k].tobytes(), k
    t.step(batches[1])
    assert t.step_count == 2


def test_compile_cache_keeps_data_parallel_executables_apart(tmp_path: Path) -> None:
    batch = golden_batches("dropout_sgd")[0]
    first = load(
        golden_bundle("dropout_sgd"),
        options=LoadOptions(
            compile=CompileOptions(cache_dir=tmp_path), parallel=ParallelOptions(devices=4)
        ),
    )
    again = load(
        golden_bundle("dropout_sgd"),
        options=LoadOptions(
            compile=CompileOptions(cache_dir=tmp_path), parallel=ParallelOptions(devices=4)
        ),
    )
    other = load(
        golden_bundle("dropout_sgd"),
        options=LoadOptions(
            compile=CompileOptions(cache_dir=tmp_path), parallel=ParallelOptions(devices=2)
        ),
    )
    assert (first.load_info.compiled, first.load_info.cache_hits) == (1, 0)
    assert (again.load_info.compiled, again.load_info.cache_hits) == (0, 1)
    assert (other.load_info.compiled, other.load_info.cache_hits) == (1, 0)
    assert float(again.step(batch)["loss"]) == float(first.step(batch)["loss"])
    # An executable stays bound to its devices: cpu:1 cannot reuse cpu:0's (it would
    # fail at its first step), so it compiles its own, and runs.
    on_0 = load(
        golden_bundle("dropout_sgd"),
        device="cpu:0",
        options=LoadOptions(compile=CompileOptions(cache_dir=tmp_path)),
    )
    on_1 = load(
        golden_bundle("dropout_sgd"),
        device="cpu:1",
        options=LoadOptions(compile=CompileOptions(cache_dir=tmp_path)),
    )
    assert (on_1.load_info.compiled, on_1.load_info.cache_hits) == (1, 0)
    assert on_1.device != on_0.device
    assert float(on_1.step(batch)["loss"]) == float(on_0.step(batch)["loss"])


def test_eval_entry_and_short_bucket_on_four_devices() -> None:
    one = load(golden_bundle("linear_adamw"))
    four = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(parallel=ParallelOptions(devices=4)),
    )
    batch = golden_batches("linear_adamw")[1]
    want, got = one.evaluate(batch), four.evaluate(batch)
    assert set(got) == set(want)
    for k in want:
        assert rel(np.asarray(got[k]), np.asarray(want[k])) <= TOL, k
    # The bundle's short bucket (5 rows) cannot split over 4 devices; the full one can.
    short = {k: v[:5] for k, v in batch.items()}
    held = list(four._store.buffers)
    with pytest.raises(BindingError) as err:
        four.step(short)
    msg = str(err.value)
    assert "has 5 rows" in msg and "{x: f32[8,5], y: f32[8,3]}" in msg
    assert not any(a.is_deleted() for a in held) and four.step_count == 0
    one.step(short)  # on one device it runs


def test_bucket_that_does_not_split_is_refused() -> None:
    with pytest.raises(PlatformError) as err:
        load(
            golden_bundle("batchnorm_lr"),
            options=LoadOptions(parallel=ParallelOptions(devices=4)),
        )
    msg = str(err.value)
    assert "batch input 'x' has 10 rows" in msg and "4 devices" in msg
    assert "multiple of 4" in msg


def test_device_requests_that_cannot_be_met_are_clear_errors() -> None:
    with pytest.raises(PlatformError, match="needs 64 cpu devices, but the job has 4"):
        load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(parallel=ParallelOptions(devices=64)),
        )
    with pytest.raises(PlatformError, match="either one device"):
        load(
            golden_bundle("linear_adamw"),
            device="cpu:1",
            options=LoadOptions(parallel=ParallelOptions(devices=2)),
        )
    with pytest.raises(UsageError, match="a number or 'all'"):
        load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(parallel=ParallelOptions(devices="most")),
        )
    t = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(parallel=ParallelOptions(devices="all")),
    )
    assert len(t.devices) == len(jax.devices("cpu"))


@pytest.mark.parametrize("first, second", [(4, 1), (1, 4), (2, 4)])
def test_checkpoints_move_between_device_counts(first: int, second: int, tmp_path: Path) -> None:
    name = "dropout_sgd"
    batches = golden_batches(name)
    straight, losses = _run(name, steps=5)
    a = load(
        golden_bundle(name),
        options=LoadOptions(parallel=ParallelOptions(devices=first)),
    )
    a.run(batches, 2)
    ckpt = tmp_path / "mid.safetensors"
    a.save_checkpoint(ckpt)
    b = load(
        golden_bundle(name),
        options=LoadOptions(parallel=ParallelOptions(devices=second)),
    )
    b.load_checkpoint(ckpt)
    assert b.step_count == 2 and b.seed == a.seed
    rest = b.run(batches, 3, offset=2)
    _assert_close(
        b.state_dict(),
        straight.state_dict(),
        np.array([float(m["loss"]) for m in rest]),
        losses[2:],
    )


@pytest.mark.parametrize("zero1", [False, True])
def test_scalar_state_keeps_its_shape_on_several_devices(zero1: bool, tmp_path: Path) -> None:
    """0-d state (num_batches_tracked, Adam's step) stays 0-d on every device, so its
    checkpoints load anywhere."""
    for name in ("batchnorm_lr", "linear_adamw"):
        one = load(
            golden_bundle(name),
            options=LoadOptions(state=StateOptions(pack_state=False)),
        )
        two = load(golden_bundle(name), options=LoadOptions(state=StateOptions(pack_state=False), parallel=ParallelOptions(devices=2, shard_optimizer_state=zero1)))  # fmt: skip
        shapes = {k: v.shape for k, v in one.state_dict().items()}
        assert any(s == () for s in shapes.values())
        for buf in two._store.buffers:
            assert {tuple(s.data.shape) for s in buf.addressable_shards} <= {
                tuple(buf.shape),
                (buf.shape[0] // 2, *buf.shape[1:]) if buf.ndim else (),
            }
        assert {k: v.shape for k, v in two.state_dict().items()} == shapes
        two.save_checkpoint(tmp_path / f"{name}.safetensors")
        one.load_checkpoint(tmp_path / f"{name}.safetensors")
        two.load_checkpoint(tmp_path / f"{name}.safetensors")
        assert {k: v.shape for k, v in two.state_dict().items()} == shapes


def _optimizer_bytes(name: str, n: int) -> tuple[int, int]:
    """(all optimizer-state bytes, bytes of those ZeRO-1 can split over n devices)."""
    with open_bundle(golden_bundle(name)) as b:
        opt = [s for s in b.manifest.state if s.kind == StateKind.OPTIMIZER_STATE]
        total = sum(s.spec.nbytes for s in opt)
        split = sum(s.spec.nbytes for s in opt if s.spec.shape and s.spec.shape[0] % n == 0)
    return total, split


def test_zero1_splits_optimizer_state_and_computes_the_same(tmp_path: Path) -> None:
    name, n = "dropout_sgd", 4
    replicated, losses_r = _run(name, devices=n)
    sharded, losses_s = _run(name, devices=n, shard_optimizer_state=True)
    _assert_close(sharded.state_dict(), replicated.state_dict(), losses_s, losses_r)
    full = replicated.state_bytes_per_device()
    part = sharded.state_bytes_per_device()
    assert len(part) == n and len(set(part.values())) == 1
    _, split = _optimizer_bytes(name, n)
    assert split > 0
    # Every device holds 1/n of the split optimizer state instead of all of it.
    for dev, nbytes in part.items():
        assert full[dev] - nbytes == split - split // n, (full[dev], nbytes, split)
    # Checkpoints of a ZeRO-1 run are ordinary full-state checkpoints.
    sharded.save_checkpoint(tmp_path / "z.safetensors")
    values, _ = read_safetensors(tmp_path / "z.safetensors")
    for k, v in replicated.state_dict().items():
        assert values[k].shape == v.shape
    one = load(golden_bundle(name))
    one.load_checkpoint(tmp_path / "z.safetensors")
    _assert_close(one.state_dict(), replicated.state_dict())


def _launch(name: str, tmp_path: Path, mode: str = "", timeout: float = 150) -> list[str]:
    """Run dp_child.py as 2 processes x 2 CPU devices; return their outputs."""
    port = _free_port()
    child = [sys.executable, str(HERE / "dp_child.py")]
    tail = [str(tmp_path)] + ([mode] if mode else [])
    outs = _job(
        [[*child, str(i), "2", str(port), "2", name, *tail] for i in range(2)], timeout=timeout
    )
    for code, log, _ in outs:
        assert code == 0, log[-3000:]
    return [log for _, log, _ in outs]


def _job(
    commands: list[list[str]], *, timeout: float = 150, stderr_apart: bool = False
) -> list[tuple[int, str, str]]:
    """Run the processes of one job side by side (without the tests' XLA_FLAGS); each
    one's exit code, stdout and stderr (stderr within stdout unless ``stderr_apart``).
    Whatever is still running when this returns or raises is killed."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    err = subprocess.PIPE if stderr_apart else subprocess.STDOUT
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        for c in commands
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, e or "") for p, (out, e) in zip(procs, outs)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "name, layout", [("dropout_sgd", "dp"), ("dropout_sgd", "zero1"), ("dropout_sgd", "fsdp")]
)
def test_two_processes_run_one_data_parallel_job(name: str, layout: str, tmp_path: Path) -> None:
    """2 processes x 2 CPU devices, joined through jax.distributed on localhost (gloo).

    With ZeRO-1 the optimizer state is split over devices of both processes, with FSDP
    all of it, so reading it back (state_dict, a checkpoint streamed tensor by tensor)
    gathers it across the processes, and restoring a checkpoint puts each process's
    pieces back."""
    zero1 = layout == "zero1"
    _launch(name, tmp_path, "" if layout == "dp" else layout)
    results = [dict(np.load(tmp_path / f"process-{i}.npz")) for i in range(2)]
    # The checkpoint restores on every process to the state it was saved from.
    for r in results:
        for k in [k for k in r if k.startswith("restored/")]:
            np.testing.assert_array_equal(r[k], r["state/" + k[len("restored/") :]], err_msg=k)
    # Each process owns two devices of its own.
    assert len(set(results[0]["local_devices"]) | set(results[1]["local_devices"])) == 4
    # The two processes are one job: identical losses and state, bit for bit.
    for k in results[0]:
        if k != "local_devices":
            np.testing.assert_array_equal(results[0][k], results[1][k], err_msg=k)
    one, losses = _run(name)
    replicated = one.state_bytes_per_device()[f"{one.device.platform}:{one.device.id}"]
    held = results[0]["state_bytes"]
    if zero1:
        _, split = _optimizer_bytes(name, 4)
        assert list(held) == [replicated - split + split // 4] * 2
    elif layout == "fsdp":  # every tensor of dropout_sgd has a dimension 4 divides
        assert list(held) == [replicated // 4] * 2, (held, replicated)
    else:
        assert list(held) == [replicated] * 2
    state = {k[len("state/") :]: v for k, v in results[0].items() if k.startswith("state/")}
    _assert_close(state, one.state_dict(), results[0]["losses"], losses)
    # Process 0's checkpoint resumes in a single-device run.
    single = load(golden_bundle(name))
    single.load_checkpoint(tmp_path / "checkpoint.safetensors")
    assert single.step_count == GOLDEN_STEPS[name]
    _assert_close(single.state_dict(), one.state_dict())


def test_a_job_must_use_devices_of_every_process(tmp_path: Path) -> None:
    """Leaving a process out would hang the others at their first checkpoint."""
    for log in _launch("dropout_sgd", tmp_path, "partial"):
        assert "REFUSED PlatformError" in log and "leave out process(es) 1" in log, log[-2000:]


@pytest.mark.parametrize("mode", ["unwritable", "unwritable-fsdp"])
def test_a_checkpoint_process_0_cannot_write_fails_on_every_process(
    mode: str, tmp_path: Path
) -> None:
    """No process is left waiting for a file that will never come, nor in a gather:
    under FSDP process 0's write stops after the digest's reads, and it still joins the
    gathers of the reads the write would have made."""
    logs = _launch("dropout_sgd", tmp_path, mode, timeout=120)
    assert "RAISED CheckpointError: Could not write the checkpoint" in logs[0], logs[0][-2000:]
    assert "stepbundle-cannot-write-here" in logs[0]
    assert "RAISED CheckpointError: Process 0 could not write" in logs[1], logs[1][-2000:]


@pytest.mark.parametrize("given, code", [("damaged", 1), ("missing", 2), ("no-data", 2)])
def test_cli_process_that_fails_to_start_stops_the_whole_job(
    tmp_path: Path, given: str, code: int
) -> None:
    """Process 1 is given a checkpoint it cannot restore, one that is not there, or --data
    that is not there: both processes exit with a clear error instead of process 0 waiting
    for it in the first step's collective, or in the load's (a refusal made before the
    load, as an argparse check of --resume and the job's --data read were, left process 0
    waiting there: measured, still waiting 90 s and 240 s on)."""
    damaged = tmp_path / f"{given}.safetensors"
    if given == "damaged":
        damaged.write_bytes(b"not a checkpoint")
    data = str(GOLDEN_DIR / "dropout_sgd.inputs.npz")
    bad = {"--data": str(damaged)} if given == "no-data" else {"--resume": str(damaged)}
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    name = "dropout_sgd"
    procs = []
    for i in range(2):
        given_here = {"--data": data, **(bad if i == 1 else {})}
        extra = [part for flag, value in given_here.items() for part in (flag, value)]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "stepbundle", "run", str(golden_bundle(name))]
                + ["--steps", "2"]
                + ["--devices", "4", "--coordinator", f"localhost:{port}"]
                + ["--num-processes", "2", "--process-id", str(i), *extra],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    errs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=60)  # far below gloo's 30 s collective timeout x 2
            errs.append(err)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == code and str(damaged) in errs[1], errs[1][-2000:]
    assert procs[0].returncode == 1, errs[0][-2000:]
    assert "another process of the job failed to start" in errs[0], errs[0][-2000:]


def test_cli_multi_process_job_needs_more_than_one_device() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "stepbundle", "run", str(golden_bundle("dropout_sgd"))]
        + ["--steps", "1", "--data", str(GOLDEN_DIR / "dropout_sgd.inputs.npz")]
        + ["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--devices all" in r.stderr, r.stderr


@pytest.mark.parametrize("xla_flags", [None, "--xla_force_host_platform_device_count=4"])
def test_cli_runs_data_parallel_on_virtual_cpu_devices(
    tmp_path: Path, xla_flags: str | None
) -> None:
    """`--devices 4` on a CPU gives the process 4 virtual devices by itself, or uses the
    ones XLA_FLAGS asks for."""
    name = "dropout_sgd"
    outs = {}
    for n in ("1", "4"):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        if xla_flags is not None:
            env["XLA_FLAGS"] = xla_flags
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "stepbundle",
                "run",
                str(golden_bundle(name)),
                "--steps",
                "5",
                "--data",
                str(golden_bundle(name).with_suffix("").with_suffix(".inputs.npz")),
                "--json",
                "--devices",
                n,
                "--save-state",
                str(tmp_path / f"s{n}.safetensors"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        if n == "4":
            assert "x4 (layout dp, mesh data 4, " in r.stderr
        outs[n] = [float(line.split('"loss": ')[1].split(",")[0]) for line in r.stdout.splitlines()]
    assert len(outs["4"]) == 5
    assert rel(np.array(outs["4"]), np.array(outs["1"])) <= TOL
    a, _ = read_safetensors(tmp_path / "s4.safetensors")
    b, _ = read_safetensors(tmp_path / "s1.safetensors")
    _assert_close(a, b)


def test_two_processes_read_disjoint_rows_of_a_dataset_and_match_one_device(
    tmp_path: Path,
) -> None:
    from stepbundle.runtime.data.dataset import open_dataset
    from stepbundle.runtime.data.dataset_writer import write_dataset
    from stepbundle.runtime.data.loader import Loader

    rng = np.random.default_rng(11)
    data = tmp_path / "ds"
    write_dataset(
        data,
        {
            "x": rng.standard_normal((64, 5)).astype(np.float32),
            "y": rng.standard_normal((64, 3)).astype(np.float32),
        },
        rows_per_shard=20,
    )
    port = _free_port()
    child = [sys.executable, str(HERE / "dp_data_child.py")]
    for code, log, _ in _job(
        [[*child, str(i), "2", str(port), "2", str(data), str(tmp_path)] for i in range(2)]
    ):
        assert code == 0, log[-3000:]
    a, b = (np.load(tmp_path / f"process-{i}.npz") for i in range(2))
    # Each process gathered 4 of the 8 rows of each of the 6 global batches, and no row
    # of a batch was read by both.
    assert a["rows"].shape == b["rows"].shape == (24,)
    for step in range(6):
        ra, rb = a["rows"][4 * step : 4 * step + 4], b["rows"][4 * step : 4 * step + 4]
        assert not set(ra) & set(rb)
    one = load(golden_bundle("linear_adamw"))
    loader = Loader(open_dataset(data), 8, seed=3)
    want = [float(m["loss"]) for m in one.run(loader, 6)]
    np.testing.assert_allclose(a["losses"], want, rtol=1e-5)
    np.testing.assert_array_equal(a["losses"], b["losses"])
    assert a["rows"].tolist() + b["rows"].tolist() != []
    first_batch = Loader(open_dataset(data), 8, seed=3).epoch_order(0)[:8]
    assert sorted(a["rows"][:4].tolist() + b["rows"][:4].tolist()) == sorted(first_batch.tolist())
    _assert_close({k[6:]: a[k] for k in a.files if k.startswith("state/")}, one.state_dict())


def test_cli_sigterm_stops_every_process_of_a_job(tmp_path: Path) -> None:
    """jax's distributed runtime keeps SIGTERM for itself; the CLI ends the process."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    name = "dropout_sgd"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "stepbundle", "run", str(golden_bundle(name))]
            + ["--steps", "1000000", "--json", "--data", str(GOLDEN_DIR / f"{name}.inputs.npz")]
            + ["--devices", "4", "--coordinator", f"localhost:{port}"]
            + ["--num-processes", "2", "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        assert procs[0].stdout is not None
        line = procs[0].stdout.readline()
        while line and not line.startswith('{"step": '):  # gloo prints to stdout first
            line = procs[0].stdout.readline()
        assert line.startswith('{"step": 0')  # both are stepping
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    # Each process ends: by its own handler (143), or, when its peer left first, by
    # XLA aborting the collective it was waiting in (SIGABRT). None is left running.
    assert 143 in codes and set(codes) <= {143, -signal.SIGABRT}, codes
    stopped = [p for p, c in zip(procs, codes) if c == 143]
    for p in stopped:
        assert p.stderr is not None
        assert "SIGTERM: stopping this process of the job" in p.stderr.read()


def test_cli_json_records_of_a_job_are_alone_on_stdout(tmp_path: Path) -> None:
    """A new user's finding: the collectives' C++ library printed "[Gloo] Rank N is
    connected ..." on stdout, ahead of process 0's --json records; it goes to stderr now,
    and stdout holds the records alone (process 1's holds nothing)."""
    name = "dropout_sgd"
    data = str(golden_bundle(name).with_suffix("").with_suffix(".inputs.npz"))
    port = _free_port()
    run = [sys.executable, "-m", "stepbundle", "run", str(golden_bundle(name)), "--no-cache"]
    run += ["--data", data, "--steps", "2", "--devices", "4", "--json"]
    run += ["--coordinator", f"localhost:{port}", "--num-processes", "2"]
    outs = _job([[*run, "--process-id", str(i)] for i in range(2)], stderr_apart=True)
    for code, _, err in outs:
        assert code == 0, err[-3000:]
    records = [json.loads(line) for line in outs[0][1].splitlines()]
    assert [r["step"] for r in records] == [0, 1], outs[0][1]
    assert outs[1][1] == "", outs[1][1]
