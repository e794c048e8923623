"""scripts/fuzz.py's cache and checkpoint targets run, pass, and see a crash.

A few dozen cases each, to prove the script works; the long runs (1,000 cases and more)
are in benchmarks/results/fuzz.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fuzz.py"


def fuzz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("target", ["cache", "checkpoint"])
def test_a_short_run_passes(target: str) -> None:
    out = fuzz("--target", target, "--cases", "30", "--jobs", "1", "--batch", "30")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "30 cases, 0 failures (0 wrong results, 0 crashes)"


def test_a_child_that_dies_is_a_crash_naming_its_case() -> None:
    out = fuzz(
        "--target", "cache", "--cases", "4", "--jobs", "1", "--batch", "2", "--abort-at", "2"
    )
    assert out.returncode == 1
    assert "FAILED (crash) the batch of cases 2..3 exited with" in out.stdout
    assert "during cache seed 0 case 2 (" in out.stdout
    assert out.stdout.splitlines()[-1] == "2 cases, 1 failures (0 wrong results, 1 crashes)"
