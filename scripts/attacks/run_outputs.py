"""Attacks on what ``stepbundle run`` and ``stepbundle eval`` write (issue #29, items 1, 2,
3, 4, 9, 20, 22, 23), performed for real: each function gets an empty folder, runs
``python -m stepbundle`` as a user would (two runs in one checkpoint folder, outputs
aimed at inputs, an lr that is 0 in float32, ``memory://``, a missing ``--eval-data``,
``--save-state`` with nothing to do, a SIGKILL before ``--resume``, eval's batch-size
flag) and raises ``AssertionError`` saying what went wrong unless the outcome is the
clean refusal (exit code, one sentence, nothing lost) or the correct result.

Run by the attack runner (``scripts/attacks.py``) with the lean environment and
PYTHONPATH set, as ``attacks()``: ``[(name, function(folder)), ...]``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20.0
TINY_LR = 1e-46  # positive as a Python float, 0 as float32


def _golden(name: str, suffix: str = ".stepbundle") -> Path:
    """A golden file of the newest format version (``linear_adamw``, ``batchnorm_lr``)."""
    folders = [p for p in (ROOT / "tests" / "golden").glob("v*.*") if p.is_dir()]
    newest = max(folders, key=lambda p: tuple(int(v) for v in re.findall(r"\d+", p.name)))
    return newest / f"{name}{suffix}"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "stepbundle", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"`{' '.join(cmd)}` still ran after {TIMEOUT_S:.0f} s") from e


def _refused(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The refusal's last stderr line, once checked: exit ``code``, no traceback, a
    sentence holding every needle."""
    err = result.stderr.strip()
    line = err.splitlines()[-1] if err else ""
    assert "Traceback" not in err, f"a traceback instead of a refusal:\n{err[-1500:]}"
    assert result.returncode == code, (
        f"expected a refusal with exit {code}, got exit {result.returncode}: {line!r}"
    )
    for needle in needles:
        assert needle in line, f"the refusal does not say {needle!r}: {line!r}"
    return line


def _base(folder: Path, name: str = "linear_adamw") -> list[str]:
    """``run`` on copies of a golden bundle and its batches (so nothing shared is at risk)."""
    bundle, data = folder / f"{name}.stepbundle", folder / f"{name}.npz"
    if not bundle.exists():
        shutil.copy(_golden(name), bundle)
        shutil.copy(_golden(name, ".inputs.npz"), data)
    return ["run", str(bundle), "--data", str(data), "--no-cache"]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def shared_checkpoint_dir(folder: Path) -> None:
    """Item 1: a second run into the folder a live run writes, then --resume after a SIGKILL."""
    ck, base = folder / "ck", _base(folder)
    first = subprocess.Popen(
        [sys.executable, "-m", "stepbundle", *base, "--steps", "100000000"]
        + ["--checkpoint-dir", str(ck), "--checkpoint-every", "20"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not list(ck.glob("step-*.safetensors")):
            assert first.poll() is None, f"the first run ended by itself ({first.returncode})"
            assert time.monotonic() < deadline, "the first run wrote no checkpoint"
            time.sleep(0.05)
        mine = sorted(ck.glob("step-*.safetensors"))[0]
        second = _cli(*base, "--steps", "3", "--checkpoint-dir", str(ck), "--resume", str(mine))
        _refused(second, 2, "in use by another run", f"process {first.pid}")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=TIMEOUT_S)
    last = sorted(ck.glob("step-*.safetensors"))[-1]
    after = _cli(*base, "--steps", "2", "--checkpoint-dir", str(ck), "--resume", str(last))
    assert after.returncode == 0, f"the dead run's lock blocked --resume: {after.stderr[-800:]}"


def outputs_onto_inputs(folder: Path) -> None:
    """Item 2: --metrics-file/--save-state/--checkpoint-dir/--tensorboard aimed at inputs."""
    import numpy as np

    from stepbundle.runtime.data.dataset_writer import write_dataset

    base = _base(folder)
    bundle = base[1]
    rows = folder / "rows"
    write_dataset(
        rows, {"x": np.zeros((12, 5), "f4"), "y": np.zeros((12, 3), "f4")}, rows_per_shard=4
    )
    ckpt = folder / "state.safetensors"
    assert _cli(*base, "--steps", "1", "--save-state", str(ckpt)).returncode == 0
    cases = [  # one of each kind (tests/runtime/test_run_outputs.py has them all)
        ["--metrics-file", bundle],
        ["--metrics-file", str(rows / "dataset.json"), "--eval-data", str(rows)],
        ["--metrics-file", str(ckpt), "--resume", str(ckpt)],
        ["--save-state", str(ckpt), "--resume", str(ckpt)],
        ["--tensorboard", str(rows), "--data", str(rows)],
    ]
    for flags in cases:
        before = _files(folder)
        _refused(_cli(*base, "--steps", "1", *flags), 2, flags[0], "Choose")
        assert _files(folder) == before, f"{' '.join(flags)}: a refused run changed a file"


def lr_zero_in_float32(folder: Path) -> None:
    """Item 3: lr=1e-46 by --set, by a schedule and from a checkpoint (capturable Adam)."""
    from stepbundle.runtime.state.checkpoint import read_checkpoint, write_checkpoint

    base = _base(folder, "batchnorm_lr")
    out = folder / "final.safetensors"
    for flags in (["--set", f"lr={TINY_LR}"], ["--lr-schedule", f"linear:start=1e-3,end={TINY_LR},total=4"]):  # fmt: skip
        r = _cli(*base, "--steps", "2", "--json", "--save-state", str(out), *flags)
        _refused(r, 1, "0 as float32")
        assert r.stdout == "" and not out.exists(), f"{flags}: a step ran or state was written"
    good = folder / "good.safetensors"
    assert _cli(*base, "--steps", "1", "--save-state", str(good)).returncode == 0
    values, meta = read_checkpoint(good)
    bad = folder / "bad.safetensors"
    write_checkpoint(bad, values, dataclasses.replace(meta, hyperparameters={"lr": TINY_LR}))
    r = _cli(*base, "--steps", "2", "--json", "--resume", str(bad), "--save-state", str(out))
    _refused(r, 1, "cannot be restored", "0 as float32")
    assert r.stdout == "" and not out.exists(), "a step ran from the checkpoint's lr"


def process_local_filesystem(folder: Path) -> None:
    """Item 4: memory:// as --checkpoint-dir and --save-state keeps nothing."""
    base = _base(folder)
    for flags in (["--checkpoint-dir", "memory://ck"], ["--save-state", "memory://s.safetensors"]):
        _refused(_cli(*base, "--steps", "2", *flags), 2, "memory://", "e.g. runs/a/")


def eval_data_missing(folder: Path) -> None:
    """Item 9: a missing --eval-data with --eval-every 999 is refused before step 0."""
    base = _base(folder)
    r = _cli(*base, "--json", "--steps", "1000", "--eval-every", "999",
             "--eval-data", str(folder / "no-such-folder"))  # fmt: skip
    _refused(r, 2, "cannot read --eval-data")
    assert r.stdout == "", "steps ran before --eval-data was refused"


def save_state_at_until_step(folder: Path) -> None:
    """Item 20: --until-step already reached still writes --save-state."""
    from stepbundle.runtime.state.checkpoint import read_checkpoint

    base = _base(folder)
    first, again = folder / "first.safetensors", folder / "again.safetensors"
    assert _cli(*base, "--steps", "2", "--save-state", str(first)).returncode == 0
    r = _cli(*base, "--until-step", "2", "--resume", str(first), "--save-state", str(again))
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-800:]}"
    assert again.exists(), "--save-state was skipped because --until-step was reached"
    (want, want_meta), (got, meta) = read_checkpoint(first), read_checkpoint(again)
    assert meta.step == want_meta.step and all((got[k] == want[k]).all() for k in want), (
        "--save-state does not hold the resumed state"
    )


def metrics_after_sigkill(folder: Path) -> None:
    """Item 22: SIGKILL, a torn last line, --resume: one metrics row per step."""
    from stepbundle.runtime.state.checkpoint import read_checkpoint

    ck, metrics = folder / "ck", folder / "metrics.jsonl"
    base = [*_base(folder), "--checkpoint-dir", str(ck), "--metrics-file", str(metrics)]
    run = subprocess.Popen(
        [sys.executable, "-m", "stepbundle", *base, "--steps", "100000000"]
        + ["--checkpoint-every", "25"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert run.poll() is None, f"the run ended by itself ({run.returncode})"
            assert time.monotonic() < deadline, "no rows past a checkpoint in time"
            kept = sorted(ck.glob("step-*.safetensors"))
            lines = metrics.read_text().splitlines()[:-1] if metrics.exists() else []
            if kept and len(lines) > read_checkpoint(kept[-1])[1].step + 3:
                break
            time.sleep(0.05)
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=TIMEOUT_S)
    with metrics.open("a") as f:
        f.write('{"step": 99999, "ti')  # what a kill in the middle of a write leaves
    last = sorted(ck.glob("step-*.safetensors"))[-1]
    end = read_checkpoint(last)[1].step + 5
    r = _cli(*base, "--until-step", str(end), "--resume", str(last))
    assert r.returncode == 0, f"the resume failed: {r.stderr[-800:]}"
    try:
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    except ValueError as e:
        raise AssertionError(f"the metrics file holds a line that is not JSON ({e})") from None
    assert steps == list(range(end)), f"not one row per step: {steps}"


def eval_batch_size_flag(folder: Path) -> None:
    """Item 23: `eval --eval-batch-size` (run's name) works; `--batch-size` notes it."""
    import numpy as np

    from stepbundle.runtime.data.dataset_writer import write_dataset

    rows = folder / "rows"
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(13, 5)).astype("f4"), rng.normal(size=(13, 3)).astype("f4")
    write_dataset(rows, {"x": x, "y": y}, rows_per_shard=5)
    base = ["eval", _base(folder)[1], "--data", str(rows), "--no-cache", "--json"]
    new, old = _cli(*base, "--eval-batch-size", "5"), _cli(*base, "--batch-size", "5")
    assert new.returncode == 0, f"eval --eval-batch-size: {new.stderr[-800:]}"
    assert old.returncode == 0, f"eval --batch-size: {old.stderr[-800:]}"
    notes = [x for x in old.stderr.splitlines() if "deprecated" in x]
    assert len(notes) == 1 and "--eval-batch-size" in notes[0], (
        f"the old name printed no one-line note naming the new one: {old.stderr[-800:]}"
    )
    assert json.loads(new.stdout) == json.loads(old.stdout), "the two names disagree"


def attacks() -> list[tuple[str, Callable[[Path], None]]]:
    return [
        ("run: two runs share one --checkpoint-dir", shared_checkpoint_dir),
        ("run: outputs aimed at inputs", outputs_onto_inputs),
        ("run: an lr that is 0 in float32", lr_zero_in_float32),
        ("run: memory:// as an output", process_local_filesystem),
        ("run: --eval-data missing until the first evaluation", eval_data_missing),
        ("run: --save-state when --until-step is reached", save_state_at_until_step),
        ("run: metrics after SIGKILL and --resume", metrics_after_sigkill),
        ("eval: --batch-size vs run's --eval-batch-size", eval_batch_size_flag),
    ]
