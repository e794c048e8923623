"""``stepbundle run``'s sinks when writing fails or the process is killed (issue #29).

A real full filesystem: a 256 KiB tmpfs filled up to a few pages, mounted for the test
(we run as root; without the right to mount, these tests are skipped). The checkpoint
folder is elsewhere, on a disk with room. A failing sink must stop the run cleanly:
exit 1, one message naming the sink and the error, a final checkpoint, and files whose
every record is whole. And every step a checkpoint holds must be in the TensorBoard
event files the moment the checkpoint exists, so a SIGKILL then leaves no hole.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_helpers import GOLDEN_DIR, drain_terminal, golden_bundle

BUNDLE = str(golden_bundle("batchnorm_lr"))
DATA = str(GOLDEN_DIR / "batchnorm_lr.inputs.npz")


@contextlib.contextmanager
def full_filesystem(where: Path, free_bytes: int) -> Iterator[Path]:
    """A 256 KiB tmpfs at ``where`` with only about ``free_bytes`` left (whole pages)."""
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        filler = where / ".filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
        os.truncate(filler, max(0, filler.stat().st_size - free_bytes))
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "stepbundle", "run", BUNDLE, "--data", DATA]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)


def tfrecords(path: Path) -> tuple[list[bytes], int]:
    """A TFRecord file's whole records, and how many bytes follow the last one."""
    raw = path.read_bytes()
    pos, out = 0, []
    while pos + 12 <= len(raw):
        (length,) = struct.unpack_from("<Q", raw, pos)
        if pos + 12 + length + 4 > len(raw):
            break
        out.append(raw[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
    return out, len(raw) - pos


def train_steps(logdir: Path) -> list[int]:
    """The steps of every ``train/loss`` value in the event files of ``logdir``; asserts
    that no file ends in a torn record."""
    from tensorboardX.proto.event_pb2 import Event

    steps = []
    for events in sorted(logdir.glob("events.out.tfevents.*")):
        records, torn = tfrecords(events)
        assert torn == 0, f"{events.name} ends in a torn record of {torn} bytes"
        for record in records:
            event = Event()
            event.ParseFromString(record)
            steps += [event.step for v in event.summary.value if v.tag == "train/loss"]
    return steps


def checkpoints(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1].split(".")[0]) for p in folder.glob("step-*"))


def test_a_full_disk_under_the_metrics_file_stops_cleanly(tmp_path: Path) -> None:
    """Before: a traceback, no final checkpoint, and a torn last line."""
    ck = tmp_path / "ck"
    with full_filesystem(tmp_path / "small", 8192) as small:
        metrics = small / "metrics.jsonl"
        r = run("--steps", "5000", "--metrics-file", str(metrics), "--checkpoint-dir", str(ck))
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert "--metrics-file" in r.stderr and "No space left on device" in r.stderr, r.stderr
        text = metrics.read_text()
        assert text.endswith("\n"), "a torn last line was left"
        steps = [json.loads(line)["step"] for line in text.splitlines()]
        assert steps == list(range(len(steps))) and len(steps) > 10
        # The final checkpoint holds every step run, at least every step logged.
        final = checkpoints(ck)
        assert final and final[-1] >= steps[-1] + 1, (final, steps[-1])
        # With room again, a resumed run appends whole lines after the last whole one.
        (small / ".filler").unlink()
        resumed = run(
            "--steps", "3", "--metrics-file", str(metrics), "--checkpoint-dir", str(ck),
            "--resume", str(ck / f"step-{final[-1]:08d}.safetensors"),
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        lines = metrics.read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines][-3:] == [
            final[-1] + i for i in range(3)
        ]


def test_a_run_cuts_a_torn_last_line_before_appending(tmp_path: Path) -> None:
    """A run killed mid-line left ``{"step": 0, "ti``; the next run appended after it."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0, "ti')
    r = run("--steps", "2", "--metrics-file", str(metrics))
    assert r.returncode == 0, r.stderr
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    assert "torn" in r.stderr, r.stderr


def test_a_fresh_run_does_not_mix_its_rows_with_an_earlier_runs(tmp_path: Path) -> None:
    """Without --resume a run starts at step 0: appended after an earlier run's rows, the
    file would hold two runs' step 0. Refused, the file untouched (--resume continues it)."""
    metrics = tmp_path / "m.jsonl"
    before = '{"step": 0, "time": 0.1}\n{"step": 1, "time": 0.2}\n'
    metrics.write_text(before)
    r = run("--steps", "2", "--metrics-file", str(metrics))
    assert r.returncode == 2, r.stderr
    assert "already holds an earlier run's rows (its last is step 1)" in r.stderr
    assert metrics.read_text() == before


def test_a_full_disk_under_tensorboard_stops_cleanly(tmp_path: Path) -> None:
    """Before: tensorboardX's writer thread died, its queue filled, and the run hung at
    0% CPU for ever (here: the 60 s timeout), with no checkpoint."""
    ck = tmp_path / "ck"
    with full_filesystem(tmp_path / "small", 8192) as small:
        tb = small / "tb"
        r = run("--steps", "5000", "--tensorboard", str(tb), "--checkpoint-dir", str(ck))
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert "--tensorboard" in r.stderr and "No space left on device" in r.stderr, r.stderr
        steps = train_steps(tb)
        assert steps == list(range(len(steps))) and len(steps) > 10
        final = checkpoints(ck)
        assert final and final[-1] >= steps[-1] + 1, (final, steps[-1])


def test_sigkill_right_after_a_checkpoint_leaves_no_hole_in_tensorboard(tmp_path: Path) -> None:
    """Every step a checkpoint holds is in the event files once the checkpoint exists.

    tensorboardX's flush() flushed the event file but not the queue in front of it, so the
    events of the step just before a checkpoint were often still queued, then sat in the
    file's buffer: a SIGKILL soon after left a hole there. (The job test of
    tests/exporter/test_training_job.py did not see it: it logs every step, so the buffer
    spills to the file every few steps, long before its kill arrives.) Here only every
    50th step is logged, and the kill comes as soon as the step-200 checkpoint exists.
    """
    ck, tb = tmp_path / "ck", tmp_path / "tb"
    cmd = [
        sys.executable, "-m", "stepbundle", "run", BUNDLE, "--data", DATA,
        "--steps", "1000000", "--log-every", "50", "--checkpoint-every", "100",
        "--checkpoint-dir", str(ck), "--tensorboard", str(tb),
    ]  # fmt: skip
    target = ck / "step-00000200.safetensors"
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not target.exists():
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline, "no checkpoint within 60 s"
            time.sleep(0.001)
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.communicate()
    assert p.returncode == -signal.SIGKILL
    steps = sorted(set(train_steps(tb)))
    assert [s for s in steps if s < 200] == [49, 99, 149, 199], steps


def _on_a_terminal(argv: list[str]) -> tuple[int, list[str]]:
    """Run ``argv`` with its stderr on a pseudo-terminal 100 columns wide (so the run draws
    its bar): the exit code and the lines the terminal shows at the end."""
    import fcntl
    import pty
    import termios

    from test_cli_logging import screen

    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=terminal)  # fmt: skip
    os.close(terminal)
    received = drain_terminal(controller)
    return proc.wait(timeout=300), screen(received.decode().replace("\r\n", "\n"))


def test_a_periodic_checkpoint_that_fails_is_said_above_the_bar(tmp_path: Path) -> None:
    """Before: the failure was printed plainly while the bar was on the terminal, so the
    bar stayed on the line above the message and was drawn again below it when it closed.
    Now it goes through the bar's own write: the message, then the bar, once."""
    with full_filesystem(tmp_path / "full", 4096) as ck:  # the lock file fits, no checkpoint
        cmd = [sys.executable, "-m", "stepbundle", "run", BUNDLE, "--data", DATA]
        code, shown = _on_a_terminal(
            [*cmd, "--steps", "40", "--checkpoint-dir", str(ck), "--checkpoint-every", "20"]
        )
    said = [i for i, line in enumerate(shown) if "could not write" in line]
    assert code == 1 and len(said) == 1, shown
    assert shown[said[0]].startswith(f"[run] could not write {ck}/step-00000020"), shown
    bars = [i for i, line in enumerate(shown) if "/40 " in line]
    assert len(bars) == 1 and bars[0] == said[0] + 1, shown


def test_a_checkpoint_folder_on_a_full_disk_is_refused_before_loading(tmp_path: Path) -> None:
    """Before: writing the run's id into its lock file raised OSError (ENOSPC) out of the
    command: a traceback, exit 1."""
    with full_filesystem(tmp_path / "full", 0) as ck:
        r = run("--steps", "4", "--checkpoint-dir", str(ck))
        assert not (ck / ".stepbundle-run.lock").exists()  # removed on the way out
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "cannot write its run lock" in r.stderr and "No space left" in r.stderr, r.stderr
    assert "[run] loaded" not in r.stderr, r.stderr
