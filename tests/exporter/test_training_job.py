"""A CIFAR-sized training job end to end, as a user would run it (issue #14's first "Done when").

``examples/cifar_cnn.py`` is exported once; a synthetic train set (labels that depend on
the pixels) is written as a sharded dataset folder larger than the memory the run may
take, and a small val set beside it. The lean environment (no torch) then runs
``stepbundle run`` with evaluation, TensorBoard, a metrics file and checkpoints, in
children whose data memory is capped by ``RLIMIT_DATA``: once uninterrupted, and once
killed with SIGKILL after a checkpoint and resumed from the newest one with the same
command plus ``--resume``. The two must end bit-identical: the final checkpoints' every
tensor and metadata (step, data position, hyperparameters, schedules), and every reported
train and eval metric, step by step, including the steps the killed run repeated.

The cap: ``RLIMIT_DATA`` counts private writable memory (heap, thread stacks, XLA's
buffers), not the read-only file maps the loader reads shards through. Its baseline is
the peak ``VmData`` of the same command on the small val set (compiled programs taken
from the cache, as in the capped runs: compiling takes ~150 MiB more; glibc's mmap
threshold fixed, see ``ENV``); the cap is that
plus ``HEADROOM``, which is smaller than the train set, so a run that read the dataset
into memory would fail (``tests/runtime/test_data.py`` shows that control).

Needs torch (to export), so it lives with the exporter tests; the runs use the lean
environment's python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fast_compile import without_fast_compile

from stepbundle.runtime.data.dataset_writer import write_dataset
from stepbundle.runtime.state.checkpoint import read_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cifar_cnn.py"

BATCH = 64  # the recipe's traced batch
TRAIN_ROWS, ROWS_PER_SHARD = 14_000, 2_000  # 7 shards, ~43 MB
VAL_ROWS = 1_000  # a short last eval batch (1000 = 15 * 64 + 40), padded
EPOCHS = 2
STEPS = EPOCHS * (TRAIN_ROWS // BATCH)  # 436: the last short batch is dropped
HEADROOM = 30 * 2**20  # the cap above the baseline, smaller than the train set
CHECKPOINT_EVERY, EVAL_EVERY = 50, 100
KILL_AFTER = 200  # SIGKILL once this step's checkpoint exists
# A fixed mmap threshold: glibc's default one rises after the first free of a large
# block, after which XLA's ~28 MB per-step temp buffers come from per-thread arenas that
# keep them, and VmData grows by 28 MB for every thread that once ran a step, at random.
# Fixed, blocks of 1 MiB and more are unmapped when freed, and VmData is what is in use.
# The runs compile at the product's defaults, without the tests' -O0 flag (conftest.py):
# they execute ~940 steps, and -O0's slower code costs more than its faster compiles save
# (the whole file: 148.5 s of processor time at the defaults, 243.4 s at -O0).
ENV = {
    **os.environ,
    "XLA_FLAGS": without_fast_compile(os.environ.get("XLA_FLAGS", "")),
    "JAX_PLATFORMS": "cpu",
    "MALLOC_MMAP_THRESHOLD_": str(2**20),
}


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("cifar_cnn", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Job:
    bundle: Path
    train: Path
    val: Path
    cache: Path
    train_bytes: int
    export_s: float


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, example_bundle: Any) -> Job:
    root = tmp_path_factory.mktemp("cifar_job")
    # `stepbundle export` in a child process, once per session (test_export_examples.py
    # trains the same bundle)
    bundle, export_s = example_bundle(EXAMPLE.stem)
    cnn = _example()
    chunks = (cnn.labelled_images(ROWS_PER_SHARD, seed=i) for i in range(7))
    write_dataset(root / "train", chunks, stacked=True, rows_per_shard=ROWS_PER_SHARD)
    write_dataset(root / "val", [cnn.labelled_images(VAL_ROWS, seed=100)], stacked=True)
    train_bytes = sum(f.stat().st_size for f in (root / "train").iterdir())
    return Job(bundle, root / "train", root / "val", root / "cache", train_bytes, export_s)


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str
    peak_data: int  # the highest VmData seen, in bytes
    seconds: float
    cpu_seconds: float  # processor time, as last seen before it ended


def _vm_data(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


# A run that hangs fails the test instead of CI's job: a limit on the child's processor
# time (what a loaded host does not stretch; the summary line prints each run's), and a
# wall-clock backstop for a hang that burns none, far above what a loaded 2-core host takes
# (a 300 s wall limit alone was within reach of a loaded run).
CPU_LIMIT_S, WALL_LIMIT_S = 300, 1200


def _cpu_seconds(pid: int) -> float:
    """``pid``'s user + system processor time, its threads included (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(
    cmd: list[str],
    out: Path,
    *,
    cap: int | None = None,
    kill_when: Callable[[], bool] | None = None,
) -> Ran:
    """Run ``cmd`` with RLIMIT_DATA ``cap``, polling its VmData; SIGKILL it once
    ``kill_when()`` is true."""

    def limit() -> None:
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    t0 = time.perf_counter()
    with open(out.with_suffix(".out"), "w") as so, open(out.with_suffix(".err"), "w") as se:
        p = subprocess.Popen(cmd, stdout=so, stderr=se, env=ENV, preexec_fn=limit)
        peak, cpu = 0, 0.0
        try:
            while p.poll() is None:
                peak = max(peak, _vm_data(p.pid))
                if kill_when is not None and kill_when():
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                    break
                cpu = max(cpu, _cpu_seconds(p.pid))
                wall = time.perf_counter() - t0
                if cpu > CPU_LIMIT_S or wall > WALL_LIMIT_S:
                    p.kill()
                    p.wait()
                    pytest.fail(
                        f"{cmd} ran for {wall:.0f} s ({cpu:.0f} s of processor time): "
                        f"limits {CPU_LIMIT_S} s of processor time, {WALL_LIMIT_S} s"
                    )
                time.sleep(0.02)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return Ran(
        p.returncode,
        out.with_suffix(".out").read_text(),
        out.with_suffix(".err").read_text(),
        peak,
        time.perf_counter() - t0,
        cpu,
    )


def _checkpoints(folder: Path) -> list[Path]:
    return sorted(folder.glob("step-*.safetensors"))


def _command(job: Job, out: Path, *, steps: int, data: Path) -> list[str]:
    """The job's command line, its outputs under ``out``."""
    return [
        str(ROOT / ".venv-lean" / "bin" / "python"),
        "-m",
        "stepbundle",
        "run",
        str(job.bundle),
        "--data",
        str(data),
        "--epochs",
        str(EPOCHS),
        "--until-step",
        str(steps),
        "--lr-schedule",
        f"warmup_cosine:peak=3e-3,warmup=40,total={STEPS},min=1e-5",
        "--eval-data",
        str(job.val),
        "--eval-every",
        str(EVAL_EVERY),
        "--tensorboard",
        str(out / "tb"),
        "--metrics-file",
        str(out / "metrics.jsonl"),
        "--checkpoint-dir",
        str(out / "ckpt"),
        "--checkpoint-every",
        str(CHECKPOINT_EVERY),
        "--json",
        "--cache-dir",
        str(job.cache),
    ]


@dataclass(frozen=True)
class Runs:
    job: Job
    baseline: int
    cap: int
    reference: Ran
    killed: Ran
    resumed: Ran
    resumed_from: Path
    ref_dir: Path
    job_dir: Path


@pytest.fixture(scope="module")
def runs(job: Job, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("cifar_runs")
    # The baseline: the same features on the small val set, once to fill the compile
    # cache, then (from the cache, as every capped run below) 60 steps with evaluations
    # and a checkpoint, to measure.
    peaks = {}
    for name, steps, every in (("warm", 4, 2), ("baseline", 60, 20)):
        (root / name).mkdir()
        small = _command(job, root / name, steps=steps, data=job.val)
        small[small.index("--eval-every") + 1] = str(every)
        small[small.index("--epochs") + 1] = "10"  # the val set is 15 batches
        base = _run(small, root / name / "run")
        assert base.returncode == 0, base.stderr
        peaks[name] = base.peak_data
    baseline = peaks["baseline"]
    cap = baseline + HEADROOM

    ref_dir, job_dir = root / "reference", root / "job"
    ref_dir.mkdir()
    job_dir.mkdir()
    reference = _run(_command(job, ref_dir, steps=STEPS, data=job.train), ref_dir / "run", cap=cap)
    assert reference.returncode == 0, reference.stderr

    cmd = _command(job, job_dir, steps=STEPS, data=job.train)
    target = job_dir / "ckpt" / f"step-{KILL_AFTER:08d}.safetensors"
    killed = _run(cmd, job_dir / "killed", cap=cap, kill_when=target.exists)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    newest = _checkpoints(job_dir / "ckpt")[-1]
    resumed = _run([*cmd, "--resume", str(newest)], job_dir / "resumed", cap=cap)
    assert resumed.returncode == 0, resumed.stderr
    print(
        f"\n[cifar job] train set {job.train_bytes / 1e6:.1f} MB in "
        f"{TRAIN_ROWS // ROWS_PER_SHARD} shards, {STEPS} steps; export {job.export_s:.1f}s; "
        f"baseline VmData {baseline / 2**20:.0f} MiB, cap {cap / 2**20:.0f} MiB; "
        f"peak VmData reference {reference.peak_data / 2**20:.0f} MiB "
        f"({reference.seconds:.1f}s, {reference.cpu_seconds:.1f}s cpu), killed "
        f"{killed.peak_data / 2**20:.0f} MiB ({killed.seconds:.1f}s, "
        f"{killed.cpu_seconds:.1f}s cpu), resumed from {newest.name} "
        f"{resumed.peak_data / 2**20:.0f} MiB ({resumed.seconds:.1f}s, "
        f"{resumed.cpu_seconds:.1f}s cpu)"
    )
    return Runs(job, baseline, cap, reference, killed, resumed, newest, ref_dir, job_dir)


def test_the_dataset_is_larger_than_the_memory_the_runs_may_take(runs: Runs) -> None:
    assert runs.job.train_bytes > HEADROOM * 1.3
    for ran in (runs.reference, runs.killed, runs.resumed):
        assert 0 < ran.peak_data <= runs.cap


def test_the_killed_run_stopped_in_the_middle_after_a_checkpoint(runs: Runs) -> None:
    step = int(runs.resumed_from.stem.split("-")[1])
    assert KILL_AFTER <= step < STEPS
    assert "--resume" not in runs.killed.stderr


def _state(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...], bytes]], Any]:
    values, meta = read_checkpoint(path)
    return {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in values.items()}, meta


def test_resumed_state_is_bit_identical_to_the_uninterrupted_run(runs: Runs) -> None:
    final = f"step-{STEPS:08d}.safetensors"
    ref_values, ref_meta = _state(runs.ref_dir / "ckpt" / final)
    values, meta = _state(runs.job_dir / "ckpt" / final)
    assert values.keys() == ref_values.keys()
    assert [k for k in values if values[k] != ref_values[k]] == []
    assert meta.step == ref_meta.step == STEPS
    assert meta.data == ref_meta.data  # the loader's position: epoch, order, offset
    assert meta.hyperparameters == ref_meta.hyperparameters
    assert meta.schedules == ref_meta.schedules
    assert meta.seed == ref_meta.seed
    assert meta.sha256 == ref_meta.sha256


def _records(lines: list[str]) -> dict[tuple[int, str], dict[str, Any]]:
    """JSON lines by (global step, train or eval), wall times dropped; a step reported
    twice (before the kill and again after the resume) must be reported identically."""
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for line in lines:
        rec = json.loads(line)
        rec.pop("time", None)
        kind = "eval" if "eval" in rec or any(k.startswith("eval/") for k in rec) else "train"
        key = (rec["step"], kind)
        assert out.setdefault(key, rec) == rec, (key, out[key], rec)
    return out


def test_every_reported_metric_is_bit_identical(runs: Runs) -> None:
    ref = _records(runs.reference.stdout.splitlines())
    assert len([k for k in ref if k[1] == "train"]) == STEPS
    assert len([k for k in ref if k[1] == "eval"]) == STEPS // EVAL_EVERY
    job = _records([*runs.killed.stdout.splitlines(), *runs.resumed.stdout.splitlines()])
    assert job == ref
    resumed = _records(runs.resumed.stdout.splitlines())
    assert min(step for step, _ in resumed) == int(runs.resumed_from.stem.split("-")[1])
    # The metrics files (the job's appended to by both runs) say the same, with the lr.
    ref_file = _records((runs.ref_dir / "metrics.jsonl").read_text().splitlines())
    job_file = _records((runs.job_dir / "metrics.jsonl").read_text().splitlines())
    assert job_file == ref_file
    assert ref_file[(STEPS - 1, "train")]["loss"] == ref[(STEPS - 1, "train")]["loss"]
    # It learned: the last eval is far better than chance (ln 10 = 2.30).
    last_eval = max(k for k in ref if k[1] == "eval")
    assert ref[last_eval]["eval"]["loss"] < 1.0


def _tfrecords(path: Path) -> Iterator[bytes]:
    """A TFRecord file's records (length, its CRC, data, its CRC; CRCs checked in
    tests/runtime/test_cli_logging.py); a record cut short by the kill is left out."""
    raw = path.read_bytes()
    pos = 0
    while pos + 12 <= len(raw):
        (length,) = struct.unpack_from("<Q", raw, pos)
        if pos + 12 + length + 4 > len(raw):
            return
        yield raw[pos + 12 : pos + 12 + length]
        pos += 12 + length + 4


def _scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    for events in sorted(logdir.glob("events.out.tfevents.*")):
        for record in _tfrecords(events):
            event = Event()
            event.ParseFromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_tensorboard_holds_train_and_eval_curves(runs: Runs) -> None:
    ref = _scalars(runs.ref_dir / "tb")
    assert {"train/loss", "train/accuracy", "train/grad_norm", "eval/loss"} <= ref.keys()
    assert sorted(ref["train/loss"]) == list(range(STEPS))
    assert len(ref["eval/loss"]) == STEPS // EVAL_EVERY
    assert np.mean(list(ref["train/loss"].values())[-20:]) < ref["train/loss"][0]
    # The killed and the resumed run's event files, read together: every value they
    # hold is the uninterrupted run's, and every step from the resume point on is there.
    job = _scalars(runs.job_dir / "tb")
    resumed_from = int(runs.resumed_from.stem.split("-")[1])
    for tag in ("train/loss", "eval/loss", "hyperparameters/param_groups.0.lr"):
        assert {s: v for s, v in job[tag].items() if v != ref[tag][s]} == {}, tag
        assert {s for s in ref[tag] if s >= resumed_from} <= job[tag].keys(), tag


# Every reported step is written through to the event file as it comes, so a SIGKILL
# after a checkpoint leaves no hole in the curves before the step the resume starts from.
# This test passed even when that was false (tensorboardX's flush() left the steps still
# in its queue behind): the job logs every step, so the file's buffer spilled every few
# steps, long before the kill. tests/runtime/test_sink_failures.py catches the real case
# (every 50th step logged, the kill the moment the checkpoint appears).
def test_tensorboard_keeps_every_step_before_the_resume_point(runs: Runs) -> None:
    job = _scalars(runs.job_dir / "tb")
    assert sorted(job["train/loss"]) == list(range(STEPS))
