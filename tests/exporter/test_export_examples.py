"""`stepbundle export` works on every recipe in examples/, and the bundles run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if "def recipe(" in p.read_text())


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_exports_and_trains(
    example: Path, tmp_path: Path, lean_python: str, example_bundle: Any
) -> None:
    # `stepbundle export` in a child process, shared with other tests of the same example
    # (conftest.py's example_bundle; test_training_job.py trains examples/cifar_cnn.py's)
    bundle, _ = example_bundle(example.stem)
    data = tmp_path / "data.npz"
    made = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "make_data.py"),
            f"{example}:data",
            str(data),
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    run = subprocess.run(
        [
            lean_python,
            "-m",
            "stepbundle",
            "run",
            str(bundle),
            "--steps",
            "30",
            "--data",
            str(data),
            "--json",
            "--no-cache",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    losses = [json.loads(line)["loss"] for line in run.stdout.splitlines()]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns
