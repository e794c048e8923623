"""``--metrics-file`` keeps every row it should (issue #29 review): only a run that
writes rows trims the file, a live run's file is refused rather than trimmed from under
it, only local paths are written, and a file of other lines is refused untouched.

Everything but the two ``MetricsFile`` checks goes through the real CLI and file system: in
a child process, or, for a refusal made before anything loads, ``stepbundle.cli.main`` in
this one (``cli_here``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_helpers import GOLDEN_DIR, cli_here, golden_bundle

BUNDLE = golden_bundle("linear_adamw")  # has an "eval" entry
NPZ = GOLDEN_DIR / "linear_adamw.inputs.npz"
BASE = ["run", str(BUNDLE), "--data", str(NPZ)]


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepbundle", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


# ------------------------------------------- 1: runs that write no rows trim no rows
def test_runs_that_write_no_rows_leave_the_metrics_file_alone(tmp_path: Path) -> None:
    """Before: both runs below printed "dropped 20 line(s)" and cut rows 10-29."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    first = cli_here(*BASE, "--steps", "30", "--checkpoint-every", "10",
                     "--checkpoint-dir", str(ck), "--metrics-file", str(metrics))  # fmt: skip
    assert first.returncode == 0, first.stderr
    written = metrics.read_bytes()
    assert steps(metrics) == list(range(30))
    resume = ["--resume", str(ck / "step-00000010.safetensors"), "--metrics-file", str(metrics)]
    for flags in (
        ["--until-step", "10", "--save-state", str(tmp_path / "s.safetensors")],
        ["--entry", "eval", "--steps", "2"],
    ):
        r = cli_here(*BASE, *resume, *flags)
        assert r.returncode == 0, r.stderr
        assert "dropped" not in r.stderr, r.stderr
        assert metrics.read_bytes() == written, flags
    # A run that does write rows from step 10 on replaces the old ones.
    r = cli_here(*BASE, *resume, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck2"))
    assert r.returncode == 0, r.stderr
    assert "dropped 20 line(s)" in r.stderr, r.stderr
    assert steps(metrics) == list(range(13))


# -------------------------------------------------- 2: a live writer's file is refused
def test_a_metrics_file_a_live_run_writes_is_refused_not_trimmed(tmp_path: Path) -> None:
    """Before: B trimmed the file by renaming a copy onto it, and A went on appending to
    the deleted file: every row A wrote after that was lost."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    a = subprocess.Popen(
        [sys.executable, "-m", "stepbundle", *BASE, "--steps", "10000000", "--checkpoint-every",
         "20", "--checkpoint-dir", str(ck), "--metrics-file", str(metrics)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (ck / "step-00000020.safetensors").exists() or len(steps(metrics)) < 40:
            assert a.poll() is None, "run A ended by itself"
            assert time.monotonic() < deadline, "run A wrote no checkpoint in 120 s"
            time.sleep(0.05)
        inode = metrics.stat().st_ino
        b = cli_here(*BASE, "--steps", "3", "--resume", str(ck / "step-00000020.safetensors"),
                "--checkpoint-dir", str(tmp_path / "ckB"), "--metrics-file", str(metrics))  # fmt: skip
        assert b.returncode == 2, b.stderr
        line = b.stderr.strip().splitlines()[-1]
        assert "is being written by another run" in line and f"process {a.pid}" in line, line
        assert "[run] loaded" not in b.stderr  # refused before the bundle was loaded
        before = len(steps(metrics))
        while len(steps(metrics)) < before + 20:  # A still writes into the same file
            assert a.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert metrics.stat().st_ino == inode
    finally:
        a.send_signal(signal.SIGTERM)  # a clean stop: a final checkpoint, whole rows
        a.wait(timeout=60)
    rows = steps(metrics)
    assert rows == list(range(len(rows)))


def test_a_metrics_file_is_held_until_it_is_closed(tmp_path: Path) -> None:
    from stepbundle.cli.metrics_file import MetricsFile, MetricsFileInUseError

    path = tmp_path / "m.jsonl"
    held = MetricsFile(path)
    try:
        with pytest.raises(MetricsFileInUseError, match="is being written by another run"):
            MetricsFile(path)
    finally:
        held.close()
    MetricsFile(path).close()  # free again


def test_a_resume_cuts_only_the_rows_that_end_the_file(tmp_path: Path) -> None:
    """Rows of an earlier run that reached the same steps stay; the cut is in place."""
    from stepbundle.cli.metrics_file import MetricsFile

    path = tmp_path / "m.jsonl"
    rows = [f'{{"step": {s}, "time": 0.5}}\n' for s in [*range(6), *range(6)]]
    path.write_text("".join(rows) + '{"step": 6, "time": 0.')
    inode = path.stat().st_ino
    f = MetricsFile(path)
    try:
        f.start(resume_at=3)
    finally:
        f.close()
    assert steps(path) == [*range(6), *range(3)]
    assert (f.dropped, f.torn_bytes) == (3, len('{"step": 6, "time": 0.'))
    assert path.stat().st_ino == inode


# ------------------------------------------------ 3: local paths only, and only our rows
def test_a_url_metrics_file_is_refused_and_file_urls_are_their_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``https://../x.stepbundle`` exited 0 and appended rows to the bundle (cut
    first, at its last newline); ``file:///...`` wrote ``./file:/...``."""
    bundle = tmp_path / "x.stepbundle"
    bundle.write_bytes(BUNDLE.read_bytes())
    work = tmp_path / "work"
    work.mkdir()
    run = ["run", str(bundle), "--data", str(NPZ), "--steps", "2"]
    monkeypatch.chdir(work)  # the refusals run here (cli_here), in the child's folder
    for flag, url in (
        ("--metrics-file", "https://../x.stepbundle"),
        ("--metrics-file", "s3://bucket/m.jsonl"),
        ("--tensorboard", "https://../tb"),
    ):
        r = cli_here(*run, flag, url)
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert f"{flag} {url!r} is a URL" in line and "local path" in line, line
        assert "[run] loaded" not in r.stderr
    assert bundle.read_bytes() == BUNDLE.read_bytes()
    assert sorted(os.listdir(work)) == []
    target = tmp_path / "m.jsonl"
    r = cli(*run, "--metrics-file", f"file://{target}", cwd=work)
    assert r.returncode == 0, r.stderr
    assert steps(target) == [0, 1] and sorted(os.listdir(work)) == []
    # The check sees the path the writer writes: the bundle as a file:// URL is refused.
    r = cli_here(*run, "--metrics-file", f"file://{bundle}")
    assert r.returncode == 2 and "is the bundle" in r.stderr, r.stderr
    assert bundle.read_bytes() == BUNDLE.read_bytes()


@pytest.mark.parametrize(
    "text",
    [
        "alpha\nbeta",  # a last line without its newline, not a row: was deleted
        "alpha\nbeta\n",
        '{"a": 1}\n{"a": 2}\n',  # JSON lines of something else
        '{"step": 0, "time": 0.1}\nnot a row\n',
        'notes\n{"step": 0, "time": 0.1}\n',
    ],
)
def test_a_file_of_other_lines_is_refused_untouched(tmp_path: Path, text: str) -> None:
    from stepbundle.cli.metrics_file import MetricsFile, NotAMetricsFileError

    path = tmp_path / "notes.txt"
    path.write_text(text)
    r = cli_here(*BASE, "--steps", "2", "--metrics-file", str(path))
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert f"--metrics-file {str(path)!r} is not a metrics file" in line, line
    assert "[run] loaded" not in r.stderr
    assert path.read_text() == text
    with pytest.raises(NotAMetricsFileError):
        MetricsFile(path)
    assert path.read_text() == text
