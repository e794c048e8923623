"""The export-at-scale benchmark still runs, and its results file has the right shape
(issue #40). Runs ``benchmarks/export_scale.py`` on the tiny Llama with the torch
front-end (one child in .venv-torch) and a skipped torch_xla row, then merges that file
with another run's; never checks a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_export_scale_runs_on_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "export_scale.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "export_scale.py"), "--models", "tiny",
         "--frontends", "torch", "torch_xla", "--skip", "torch_xla:tiny",
         "--reason", "torch_xla:tiny=not run in this test", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    torch_row, xla_row = result["rows"]
    assert torch_row["model"] == "tiny" and torch_row["frontend"] == "torch"
    assert torch_row["rc"] == 0 and "failed" not in torch_row, torch_row
    assert torch_row["built_on"] == "meta"
    assert torch_row["parameters"] == 19616
    assert torch_row["bundle_bytes"] > 0
    for key in ("wall_s", "cpu_s", "peak_rss_gb", "export_s"):
        assert torch_row[key] > 0, key
    assert torch_row["wall_s"] >= torch_row["export_s"]
    assert set(torch_row["stages_s"]) >= {"trace", "lower", "write"}
    # the resident set when each stage ended: the build first, the writing last, the peak
    # never falling and never above what the parent read from the child's rusage
    readings = torch_row["rss_after_stage_gb"]
    assert readings[0]["after"] == "imports and building the recipe"
    assert readings[-1]["after"].endswith(", then writing the bundle") and len(readings) >= 4
    peaks = [r["peak_gb"] for r in readings]
    assert peaks == sorted(peaks) and 0 < peaks[-1] <= torch_row["peak_rss_gb"]
    assert all(0 < r["rss_gb"] <= r["peak_gb"] for r in readings)
    assert sum(r["added_gb"] for r in readings) == pytest.approx(peaks[-1])
    assert xla_row == {"model": "tiny", "frontend": "torch_xla", "skipped": "not run in this test"}
    lines = result["table"].splitlines()
    assert lines[2].startswith("| tiny | 0M | torch | meta |")
    assert lines[3] == "| tiny |  | torch_xla | | not done: not run in this test | | | |"
    assert result["git"]["commit"]
    assert torch_row["git"]["commit"] == result["git"]["commit"]  # each row says where
    assert len(torch_row["load_average_at_end"]) == 3

    # --merge: a later file's row replaces the same row; rows in model, front-end order;
    # a row without its own record takes its file's, or --source-git's; skipped rows none
    later = tmp_path / "later.json"
    redone = {k: v for k, v in torch_row.items() if k not in ("git", "load_average_at_end")}
    redone["wall_s"] = 1.0
    old_format = {"command": "x", "host": {"cpus": 2, "machine": "x86_64",
                  "load_average_at_end": [1.0, 2.0, 3.0]},
                  "git": {"commit": "c0ffee", "dirty": True}, "rows": [redone]}  # fmt: skip
    later.write_text(json.dumps(old_format))
    merged = tmp_path / "merged.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "export_scale.py"), "--merge", str(later),
         str(out), str(later), "--source-git", f"{later}=beef:clean", "--earlier",
         f"before={later}", "--note", "how", "--out", str(merged)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = json.loads(merged.read_text())
    assert [(r["model"], r["frontend"]) for r in both["rows"]] == [
        ("tiny", "torch"),
        ("tiny", "torch_xla"),
    ]
    assert both["rows"][0] == {
        **redone,
        "git": {"commit": "beef", "dirty": False},
        "load_average_at_end": [1.0, 2.0, 3.0],
    }
    assert both["rows"][1] == xla_row  # skipped: nothing measured, no record
    assert both["commands"] == ["x", result["command"]]  # each command once
    assert both["earlier"]["before"][0]["wall_s"] == 1.0 and both["note"] == "how"

    # a merged file merged again keeps its comparison rows
    again = tmp_path / "again.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "export_scale.py"), "--merge", str(merged),
         "--out", str(again)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(again.read_text())["earlier"] == both["earlier"]
