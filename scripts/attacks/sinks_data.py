"""Attacks on ``stepbundle run``'s sinks and on dataset folders (issue #29, items 5, 8,
21, 13, 14, 15), performed for real: each function gets an empty folder, runs
``python -m stepbundle`` (or the runtime) against a full filesystem, a SIGKILL, a
hostile index, an impossible batch or a shard truncated under the run, and raises
``AssertionError`` saying what went wrong unless the outcome is the clean refusal or the
correct result.

A full filesystem is a 256 KiB tmpfs filled to a few free pages (mounting needs root);
where mounting is refused, the file-size limit (``RLIMIT_FSIZE``) of the child stands in
for it. Every mount is unmounted before the attack returns.

Run by the attack runner (``scripts/attacks.py``) with the lean environment, as
``attacks()``: ``[(name, function(folder)), ...]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20.0


def _golden(name: str) -> Path:
    """The newest format version's golden bundle ``name``."""
    folders = [p for p in (ROOT / "tests" / "golden").glob("v*.*") if p.is_dir()]
    newest = max(folders, key=lambda p: tuple(int(v) for v in re.findall(r"\d+", p.name)))
    return newest / f"{name}.stepbundle"


def _run(args: list[str], *, fsize: int | None = None) -> subprocess.CompletedProcess[str]:
    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))
        if fsize is not None:  # the stand-in for a full disk: writes past it fail (EFBIG)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    cmd = [sys.executable, "-m", "stepbundle", "run", "--no-cache", *args]
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=limits
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"`{' '.join(cmd)}` was still running after {TIMEOUT_S:.0f} s (hung)"
        ) from e


@contextlib.contextmanager
def _full_disk(where: Path, free_bytes: int = 8192) -> Iterator[bool]:
    """Mount a nearly full tmpfs at ``where``; yields False (nothing mounted) where
    mounting is not allowed, and the caller limits the file size instead."""
    where.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True
        ).returncode
        == 0
    )
    try:
        if mounted:
            filler = where / ".filler"
            with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)
            os.truncate(filler, max(0, filler.stat().st_size - free_bytes))
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def _check(ok: bool, what: str, r: subprocess.CompletedProcess[str] | None = None) -> None:
    if not ok:
        tail = f"\nexit {r.returncode}; stderr:\n{r.stderr[-2000:]}" if r is not None else ""
        raise AssertionError(what + tail)


def _checkpoints(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1].split(".")[0]) for p in folder.glob("step-*"))


def _tfrecords(path: Path) -> tuple[list[bytes], int]:
    raw = path.read_bytes()
    pos, out = 0, []
    while pos + 12 <= len(raw):
        (length,) = struct.unpack_from("<Q", raw, pos)
        if pos + 12 + length + 4 > len(raw):
            break
        out.append(raw[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
    return out, len(raw) - pos


def _train_steps(logdir: Path) -> list[int]:
    from tensorboardX.proto.event_pb2 import Event

    steps = []
    for events in sorted(logdir.glob("events.out.tfevents.*")):
        records, torn = _tfrecords(events)
        _check(torn == 0, f"{events} ends in a torn record of {torn} bytes")
        for record in records:
            event = Event()
            event.ParseFromString(record)
            steps += [event.step for v in event.summary.value if v.tag == "train/loss"]
    return steps


def _sink_on_full_disk(tmp: Path, option: str) -> None:
    """Items 5 and 8: the run stops cleanly, exit 1, names the sink and the error, writes
    its final checkpoint (its folder has room) and leaves only whole records."""
    bundle = _golden("batchnorm_lr")
    data = bundle.with_name("batchnorm_lr.inputs.npz")
    ck = tmp / "ck"
    with _full_disk(tmp / "small") as mounted:
        target = tmp / "small" / ("metrics.jsonl" if option == "--metrics-file" else "tb")
        r = _run(
            [str(bundle), "--data", str(data), "--steps", "5000", option, str(target),
             "--checkpoint-dir", str(ck)],
            fsize=None if mounted else 8192,
        )  # fmt: skip
        _check(r.returncode == 1, f"{option} on a full disk: expected exit 1", r)
        _check("Traceback" not in r.stderr, f"{option} on a full disk: a traceback", r)
        _check(option in r.stderr, f"{option} on a full disk: the message does not name it", r)
        if option == "--metrics-file":
            text = target.read_text()
            _check(text.endswith("\n"), "the metrics file was left with a torn last line")
            steps = [json.loads(line)["step"] for line in text.splitlines()]
        else:
            steps = _train_steps(target)
        _check(steps == list(range(len(steps))), f"the logged steps are not 0, 1, ...: {steps}")
        final = _checkpoints(ck)
        _check(
            bool(final) and final[-1] >= len(steps),
            f"no final checkpoint holding the {len(steps)} logged steps: {final}",
            r,
        )


def metrics_file_on_a_full_disk(tmp: Path) -> None:
    _sink_on_full_disk(tmp, "--metrics-file")


def tensorboard_on_a_full_disk(tmp: Path) -> None:
    _sink_on_full_disk(tmp, "--tensorboard")


def sigkill_after_a_checkpoint_leaves_no_tensorboard_hole(tmp: Path) -> None:
    """Item 21: a SIGKILL the moment a checkpoint appears; every logged step up to it
    must be in the event files."""
    bundle = _golden("batchnorm_lr")
    data = bundle.with_name("batchnorm_lr.inputs.npz")
    ck, tb = tmp / "ck", tmp / "tb"
    cmd = [
        sys.executable, "-m", "stepbundle", "run", str(bundle), "--data", str(data),
        "--no-cache", "--steps", "1000000", "--log-every", "50", "--checkpoint-every", "100",
        "--checkpoint-dir", str(ck), "--tensorboard", str(tb),
    ]  # fmt: skip
    target = ck / "step-00000200.safetensors"
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not target.exists():
            _check(p.poll() is None, f"the run ended before its checkpoint: {p.returncode}")
            _check(time.monotonic() < deadline, f"no {target.name} within {TIMEOUT_S} s")
            time.sleep(0.001)
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.communicate()
    steps = sorted(set(_train_steps(tb)))
    before = [s for s in steps if s < 200]
    _check(before == [49, 99, 149, 199], f"the event files hold steps {before} below 200")


def _dataset(folder: Path, rows: int, rows_per_shard: int | None = None) -> Path:
    import numpy as np

    from stepbundle.runtime.data.dataset_writer import write_dataset

    rng = np.random.default_rng(0)
    data = {
        "x": rng.standard_normal((rows, 5), dtype=np.float32),
        "y": rng.standard_normal((rows, 3), dtype=np.float32),
    }
    write_dataset(str(folder), data, stacked=True, rows_per_shard=rows_per_shard)
    return folder


def nested_dataset_index(tmp: Path) -> None:
    """Item 13: a dataset.json nested 100,000 deep is a typed refusal."""
    from stepbundle.runtime.data.dataset import DataError, DataErrorKind, open_dataset

    ds = _dataset(tmp / "ds", 24)
    deep = "[" * 100_000 + "]" * 100_000
    (ds / "dataset.json").write_text(
        '{"format": "stepbundle.dataset", "version": 1, "rows": 24, "inputs": ' + deep + "}"
    )
    try:
        open_dataset(ds)
    except DataError as e:
        _check(e.kind is DataErrorKind.BAD_INDEX, f"refused as {e.kind}, not BAD_INDEX")
    except RecursionError as e:
        raise AssertionError("open_dataset raised RecursionError on a nested index") from e
    else:
        raise AssertionError("open_dataset accepted a nested index")
    r = _run([str(_golden("linear_adamw")), "--data", str(ds), "--steps", "1"])
    _check(r.returncode == 2 and "Traceback" not in r.stderr, "the CLI did not refuse it", r)


def batch_that_cannot_fit(tmp: Path) -> None:
    """Item 14: --batch-size 10**12 --last-batch pad is refused before allocating."""
    ds = _dataset(tmp / "ds", 24)
    t0 = time.monotonic()
    r = _run([str(_golden("linear_adamw")), "--data", str(ds), "--steps", "1",
              "--batch-size", str(10**12), "--last-batch", "pad"])  # fmt: skip
    _check(r.returncode in (1, 2), "a 10**12-row batch was not refused", r)
    _check("Traceback" not in r.stderr and "memory" in r.stderr, "no clear refusal", r)
    _check(time.monotonic() - t0 < TIMEOUT_S, "the refusal took too long")


def shard_truncated_under_the_run(tmp: Path) -> None:
    """Item 15: truncating a shard while the run reads it stops the run with exit 1 and
    a final checkpoint, never SIGBUS."""
    ds = _dataset(tmp / "ds", 8192, rows_per_shard=2048)
    ck = tmp / "ck"
    cmd = [
        sys.executable, "-m", "stepbundle", "run", str(_golden("linear_adamw")),
        "--no-cache", "--data", str(ds), "--steps", "10000000",
        "--checkpoint-every", "100", "--checkpoint-dir", str(ck),
    ]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = ""
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (ck / "step-00000100.safetensors").exists():
            _check(p.poll() is None, f"the run ended early: {p.returncode}")
            _check(time.monotonic() < deadline, "no first checkpoint in time")
            time.sleep(0.01)
        os.truncate(ds / "x-00001.npy", 4096)
        _, err = p.communicate(timeout=TIMEOUT_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    _check(p.returncode != -signal.SIGBUS, "the run died of SIGBUS")
    _check(p.returncode == 1, f"exit {p.returncode}, expected 1; stderr: {err[-1500:]}")
    _check("x-00001.npy" in err and "Traceback" not in err, f"no clear message: {err[-1500:]}")
    final = _checkpoints(ck)
    _check(bool(final) and final[-1] > 100, f"no final checkpoint after step 100: {final}")


def attacks() -> list[tuple[str, Callable[[Path], None]]]:
    """Each attack of issue #29 on the sinks and the data, by name."""
    found: list[tuple[str, Callable[[Path], None]]] = [
        ("5: --tensorboard on a full disk", tensorboard_on_a_full_disk),
        ("8: --metrics-file on a full disk", metrics_file_on_a_full_disk),
        ("21: SIGKILL after a checkpoint, TensorBoard hole", sigkill_after_a_checkpoint_leaves_no_tensorboard_hole),
        ("13: deeply nested dataset.json", nested_dataset_index),
        ("14: --batch-size 10**12 --last-batch pad", batch_that_cannot_fit),
        ("15: shard truncated under the run", shard_truncated_under_the_run),
    ]  # fmt: skip
    return found


if __name__ == "__main__":  # a quick manual run: python scripts/attacks/sinks_data.py
    import tempfile

    failed = 0
    for name, attack in attacks():
        with tempfile.TemporaryDirectory() as d:
            t0 = time.monotonic()
            try:
                attack(Path(d))
                print(f"ok    {name} ({time.monotonic() - t0:.1f}s)")
            except AssertionError as e:
                failed += 1
                print(f"FAIL  {name} ({time.monotonic() - t0:.1f}s): {e}")
    sys.exit(1 if failed else 0)
