"""scripts/device_check.sh is for accelerators (a TPU, an NVIDIA GPU) and never runs on
one in CI; CI checks that it parses and that its Python half runs through on the CPU, so
a broken script is found before a device is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_check.sh"


def test_device_check_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = SCRIPT.read_text()
    assert "benchmarks/results/device" in text  # where its results go
    assert "set -euo pipefail" in text


def test_the_device_checks_python_half_runs_on_the_cpu(tmp_path: Path) -> None:
    # benchmarks/device/check.py is what the device runs; on the CPU it must run through
    # and pass, and what it records must be what docs/tpu.md reads from it.
    out = tmp_path / "device_check.json"
    check = SCRIPT.parent.parent / "benchmarks" / "device" / "check.py"
    proc = subprocess.run(
        [sys.executable, str(check), "--platform", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["ok"] is True
    assert len(rec["golden"]) >= 9 and all(g["metrics_max_rel"] <= 1e-5 for g in rec["golden"])
    assert {r["bundle"] for r in rec["without_power_precision"]} == {
        "linear_adamw",
        "batchnorm_lr",
        "dropout_sgd",
    }
    # The runtime's exact power: correctly rounded, give or take (steps + 48) * 2**-29 ulp
    # of float64 rounding (stablehlo/pow_precision.py); the CPU's own float32 power is
    # within an ulp (it misrounds a few steps, e.g. 0.999**873, which this set skips).
    for beta in ("0.9", "0.999"):
        assert rec["adam_powers"][f"{beta}/rewrite"]["max_ulp"] <= 0.5 + (10**4 + 48) * 2.0**-29
        assert rec["adam_powers"][f"{beta}/f32"]["max_ulp"] <= 1.0
    assert all(r["metrics_identical"] and r["state_identical"] for r in rec["steps_per_call"])
