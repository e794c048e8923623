"""What a resumed run inherits (issue #29, round three): an lr that is 0 once it is the
device's float32 is refused wherever an lr enters, and the metrics file of a run killed
with SIGKILL holds one row per step after ``--resume``.

Everything here goes through the real runtime, CLI and file system.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import GOLDEN_DIR, cli_here, golden_batches, golden_bundle

from stepbundle.runtime import load
from stepbundle.runtime.errors import BindingError
from stepbundle.runtime.state.checkpoint import CheckpointError, read_checkpoint, write_checkpoint

ADAM = golden_bundle("batchnorm_lr")  # capturable Adam, lr a float32 hyperparameter
TINY = 1e-46  # positive as a Python float, 0 as float32


# ------------------------------------------------------- 3: an lr that is 0 in float32
def test_an_lr_that_is_zero_as_float32_is_refused_where_an_lr_enters(tmp_path: Path) -> None:
    assert np.float32(TINY) == 0 and TINY > 0
    t = load(ADAM)
    with pytest.raises(BindingError, match=r"1e-46, which is 0 as float32"):
        t.set_hyperparameter("lr", TINY)
    with pytest.raises(BindingError, match=r"which is 0 as float32"):
        t.set_schedule("lr", f"warmup_cosine:peak=0.01,warmup=1,total=4,min={TINY}")
    with pytest.raises(BindingError, match=r"which is 0 as float32"):
        t.set_schedule("lr", f"linear:start=0.01,end={TINY},total=4")
    assert t.hyperparameters["lr"] == pytest.approx(0.01) and not t.schedules
    t.set_hyperparameter("lr", 1e-30)  # tiny, but not 0 on the device

    # Checkpoints written before this check could carry such an lr or schedule.
    t.step(golden_batches("batchnorm_lr")[0])
    good = tmp_path / "good.safetensors"
    t.save_checkpoint(good)
    values, meta = read_checkpoint(good)
    fresh = load(ADAM)
    before = fresh.state_dict()
    for name, changed in {
        "lr": dataclasses.replace(meta, hyperparameters={"lr": TINY}),
        "schedule": dataclasses.replace(meta, schedules={"lr": f"constant:value={TINY}"}),
    }.items():
        bad = tmp_path / f"bad-{name}.safetensors"
        write_checkpoint(bad, values, changed)
        with pytest.raises(CheckpointError, match=r"cannot be restored: .*0 as float32"):
            fresh.load_checkpoint(bad)
        # Refused before anything changed.
        assert fresh.step_count == 0 and not fresh.schedules
        for k, v in fresh.state_dict().items():
            np.testing.assert_array_equal(v, before[k])

    # The CLI: refused after the load, before a step; nothing written.
    out = tmp_path / "final.safetensors"
    for flags in (["--set", f"lr={TINY}"], ["--lr-schedule", f"constant:value={TINY}"]):
        r = cli_here(
            "run", str(ADAM), "--data", str(GOLDEN_DIR / "batchnorm_lr.inputs.npz"),
            "--steps", "2", "--json", "--save-state", str(out), *flags,
        )  # fmt: skip
        assert r.returncode == 1, r.stderr
        assert "0 as float32" in r.stderr.strip().splitlines()[-1], r.stderr
        assert r.stdout == "" and not out.exists()


def test_an_lr_that_is_a_float32_subnormal_is_refused(tmp_path: Path) -> None:
    """1e-44 is not 0 as float32, but it is subnormal, and a TPU flushes it to 0."""
    sub = 1e-44
    assert np.float32(sub) != 0 and abs(np.float32(sub)) < np.finfo(np.float32).tiny
    t = load(ADAM)
    why = r"1e-44, which is a subnormal float32 .*flush subnormals to 0"
    with pytest.raises(BindingError, match=why):
        t.set_hyperparameter("lr", sub)
    with pytest.raises(BindingError, match=r"subnormal float32"):
        t.set_schedule("lr", f"linear:start=0.01,end={sub},total=4")
    t.set_hyperparameter("lr", float(np.finfo(np.float32).tiny))  # the smallest normal
    t.step(golden_batches("batchnorm_lr")[0])
    good = tmp_path / "good.safetensors"
    t.save_checkpoint(good)
    values, meta = read_checkpoint(good)
    bad = tmp_path / "bad.safetensors"
    write_checkpoint(bad, values, dataclasses.replace(meta, hyperparameters={"lr": sub}))
    with pytest.raises(CheckpointError, match=r"subnormal float32"):
        load(ADAM).load_checkpoint(bad)
    r = cli_here(
        "run", str(ADAM), "--data", str(GOLDEN_DIR / "batchnorm_lr.inputs.npz"),
        "--steps", "2", "--json", "--set", f"lr={sub}",
    )  # fmt: skip
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert "flush subnormals to 0" in r.stderr.strip().splitlines()[-1], r.stderr


# ------------------------------------------- 22: the metrics file after SIGKILL and resume
def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_file_holds_one_row_per_step_after_sigkill_and_resume(tmp_path: Path) -> None:
    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    bundle, data = golden_bundle("linear_adamw"), GOLDEN_DIR / "linear_adamw.inputs.npz"
    base = ["run", str(bundle), "--data", str(data), "--metrics-file", str(metrics)]
    base += ["--checkpoint-dir", str(ck), "--eval-data", str(data), "--eval-every", "5"]
    run = subprocess.Popen(
        [sys.executable, "-m", "stepbundle", *base, "--steps", "10000000"]
        + ["--checkpoint-every", "25"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        # Wait until the metrics file has rows past a checkpoint.
        while True:
            assert run.poll() is None, "the run ended by itself"
            assert time.monotonic() < deadline, "no checkpoint with rows past it in 120 s"
            kept = sorted(ck.glob("step-*.safetensors"))
            text = metrics.read_text() if metrics.exists() else ""
            steps = [json.loads(x)["step"] for x in text.splitlines()[:-1]]
            if kept and steps and max(steps) > read_checkpoint(kept[-1])[1].step + 3:
                break
            time.sleep(0.05)
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=60)
    kept = sorted(ck.glob("step-*.safetensors"))
    rows = metrics.read_text()
    written = max(json.loads(x)["step"] for x in rows.splitlines()[:-1])
    # The kill can land just after a new checkpoint (one every 25 steps of ~1 ms): resume
    # from the newest checkpoint the killed run wrote rows past, as a preempted job may.
    resume_from = next(p for p in reversed(kept) if written >= read_checkpoint(p)[1].step)
    resume_at = read_checkpoint(resume_from)[1].step
    assert written >= resume_at
    # A write the kill cut short: the last line is torn.
    with metrics.open("a") as f:
        f.write('{"step": 9999, "time": 1.')
    end = resume_at + 7
    resumed = cli_here(*base, "--until-step", str(end), "--resume", str(resume_from))
    assert resumed.returncode == 0, resumed.stderr
    text = metrics.read_text()
    assert text.endswith("\n")
    train = [r for r in _rows(metrics) if "loss" in r]
    evals = [r for r in _rows(metrics) if "eval/loss" in r]
    assert [r["step"] for r in train] == list(range(end)), [r["step"] for r in train]
    assert [r["step"] for r in evals] == list(range(4, end, 5))


# ------------------------------------------- --resume DIR: the folder's latest checkpoint
def test_resume_from_a_folder_takes_its_latest_checkpoint(tmp_path: Path) -> None:
    bundle, data = golden_bundle("linear_adamw"), str(GOLDEN_DIR / "linear_adamw.inputs.npz")
    ck = tmp_path / "ck"
    common = ("--data", data, "--json")
    first = cli_here("run", str(bundle), *common, "--steps", "20", "--checkpoint-dir", str(ck),
                "--checkpoint-every", "8")  # fmt: skip
    assert first.returncode == 0, first.stderr
    # 8, 16 and the final 20; a checkpoint kept before a non-finite step is taken by name only.
    (ck / "step-00000099-before-nonfinite.safetensors").write_bytes(b"not taken")
    (ck / "step-00000098.safetensors").mkdir()  # not a file: not taken
    (ck / "step-00000097.safetensors").symlink_to(tmp_path / "nowhere")  # dangling: not taken
    by_folder = cli_here("run", str(bundle), *common, "--until-step", "24", "--resume", ck.as_uri(),
                    "--save-state", str(tmp_path / "a.safetensors"))  # fmt: skip
    assert by_folder.returncode == 0, by_folder.stderr
    assert f"resumed from {ck / 'step-00000020.safetensors'} (step 20)" in by_folder.stderr
    by_file = cli_here("run", str(bundle), *common, "--until-step", "24", "--resume",
                  str(ck / "step-00000020.safetensors"), "--save-state",
                  str(tmp_path / "b.safetensors"))  # fmt: skip
    assert by_file.returncode == 0, by_file.stderr
    assert by_folder.stdout == by_file.stdout and len(by_file.stdout.splitlines()) == 4
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()

    (tmp_path / "empty").mkdir()
    empty = cli_here(
        "run", str(bundle), *common, "--steps", "2", "--resume", str(tmp_path / "empty")
    )
    assert empty.returncode == 2
    assert "is a folder holding no checkpoint" in empty.stderr.strip().splitlines()[-1]
