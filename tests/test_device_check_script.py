"""scripts/device_check.sh is for NVIDIA machines and never runs in CI; CI only checks
that it parses, so a broken script is found before a device is at hand."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_check.sh"


def test_device_check_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = SCRIPT.read_text()
    assert "benchmarks/results/device" in text  # where its results go
    assert "set -euo pipefail" in text
