"""The benchmark still runs, and its outputs have the right shape (issue #7).

Runs ``benchmarks/run.py --quick`` once, in a subprocess, and checks the JSON, the
markdown and the plot: every case has every method, every figure is a positive number,
the ratios are consistent. It never checks how fast anything is, so that subprocess
compiles at XLA's lowest code-generation effort (``FAST_COMPILE``): most of its time is
compiling the timed methods (torch_xla, dynamo, jax.jit and the bundle's programs), and
no figure it checks depends on how well the programs were optimised.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch_xla")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
METHODS = {
    "torch_xla_lazy",
    "torch_xla_dynamo_model",
    "torch_xla_dynamo_step",
    "torch_eager",
    "torch_compile",
    "jax_jit",
    "stepbundle",
    "stepbundle_k8",
    "stepbundle_k32",
    "floor",
}
DIAGNOSTIC = {
    "stepbundle",
    "stepbundle_gc_frozen",
    "floor",
    "floor_execute",
    "floor_jit",
    "packed_execute",
    "packed_jit",
}


# XLA's LLVM back-end at its lowest effort, as the export check's runtime child once ran
# (cli/step_check.py before 63f1f47): XLA's own passes all run, so the programs compute
# what they compute by default, within rounding. torch_xla and jaxlib both take the flags.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("bench")
    flags = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "XLA_FLAGS": flags},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc


@pytest.mark.heavy
def test_outputs_exist(quick: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, proc = quick
    for name in ("results.json", "results.md", "step_time.png"):
        assert (out / name).is_file(), name
        assert (out / name).stat().st_size > 0, name
    assert (out / "step_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The table is printed, and is the one in results.md.
    md = (out / "results.md").read_text()
    assert "| case | depth | graph inputs |" in md
    assert md.splitlines()[4] in proc.stdout


@pytest.mark.heavy
def test_step_time_records(quick: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = quick
    r = json.loads((out / "results.json").read_text())
    assert {"machine", "config", "step_times", "targets", "export", "diagnostics"} <= set(r)
    # The commit the figures were measured at (and whether the tree was clean).
    assert len(r["git"]["commit"]) == 40 and isinstance(r["git"]["dirty"], bool)
    cases = {("mlp", d) for d in r["config"]["depths"]} | {("gpt", r["gpt_config"]["layers"])}
    assert len(r["config"]["depths"]) >= 2
    by_case: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for rec in r["step_times"]:
        assert {"case", "depth", "method", "median_ms", "ratio_to_floor"} <= set(rec)
        assert {"ratio_to_torch_xla_lazy", "steps_per_block", "graph_inputs"} <= set(rec)
        key = (rec["case"], rec["depth"])
        assert rec["method"] not in by_case.setdefault(key, {}), "one record per method"
        by_case[key][rec["method"]] = rec
        for k in ("median_ms", "p25_ms", "p75_ms", "min_ms", "ratio_to_floor", "cpu_median_ms"):
            assert positive(rec[k]), (key, rec["method"], k, rec[k])
        assert rec["p25_ms"] <= rec["median_ms"] <= rec["p75_ms"]
        assert positive(rec["graph_inputs"])
        assert isinstance(rec["steps_per_block"], int) and rec["steps_per_block"] >= 1
        assert len(rec["samples_ms"]) == r["config"]["rounds"]
    assert set(by_case) == cases
    for key, methods in by_case.items():
        assert set(methods) >= METHODS, (key, sorted(methods))
        floor, lazy = methods["floor"]["median_ms"], methods["torch_xla_lazy"]["median_ms"]
        assert methods["floor"]["ratio_to_floor"] == pytest.approx(1.0)
        for rec in methods.values():
            assert rec["ratio_to_floor"] == pytest.approx(rec["median_ms"] / floor)
            assert rec["ratio_to_torch_xla_lazy"] == pytest.approx(rec["median_ms"] / lazy)


@pytest.mark.heavy
def test_targets_and_diagnostics(quick: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = quick
    r = json.loads((out / "results.json").read_text())
    assert r["targets"], "the targets are evaluated"
    for t in r["targets"]:
        assert isinstance(t["met"], bool) and positive(t["figure"]) and t["target"] and t["text"]
    assert r["diagnostics"]
    for d in r["diagnostics"]:
        methods = {r_["method"] for r_ in d["records"]}
        assert methods == DIAGNOSTIC if d["case"] != "wide" else methods <= DIAGNOSTIC
        assert all(positive(r_["median_ms"]) for r_ in d["records"])
        # Every variant ran the same program from the same state: the same first loss.
        losses = d["facts"]["first_loss"]
        assert losses["jit"] == pytest.approx(losses["execute"], rel=1e-5)
        assert losses["packed"] == pytest.approx(losses["execute"], rel=1e-5)
        assert d["facts"]["packed_inputs"] < d["facts"]["graph_inputs"]
        if d["case"] != "wide":
            assert d["profile"] and all(positive(p["calls_per_step"]) for p in d["profile"])


@pytest.mark.heavy
def test_other_figures(quick: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = quick
    r = json.loads((out / "results.json").read_text())
    for e in r["export"]:
        assert (
            positive(e["export_s"]) and positive(e["bundle_bytes"]) and positive(e["graph_inputs"])
        )
    assert r["load"]
    for ld in r["load"]:
        assert ld["cold"]["compiled"] >= 1 and ld["cold"]["cache_hits"] == 0
        assert ld["warm"]["cache_hits"] >= 1 and ld["warm"]["compiled"] == 0
        for k in ("cold", "warm"):
            assert positive(ld[k]["load_to_first_step_s"]) and math.isfinite(ld[k]["loss"])
    br = r["bundle_read"]
    assert positive(br["state_bytes"]) and br["file_bytes"] >= br["state_bytes"]
    for k in ("read_evicted", "read_cached", "state_transfer"):
        assert positive(br[k]["seconds"]) and positive(br[k]["mb_per_s"])
    rss = r["peak_rss"]
    for k in ("donate", "no_donate"):
        v = rss[k]
        assert v["donate"] is (k == "donate")
        for f in ("rss_after_load_kb", "rss_after_gc_kb", "peak_rss_load_kb", "peak_rss_steps_kb"):
            assert positive(v[f]), (k, f)


@pytest.mark.heavy
def test_data_pipeline_trainer_quick(tmp_path: Path) -> None:
    """``data_pipeline.py --trainer --quick``: exports, steps both sources, prints the ratio."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "data_pipeline.py"),
            "--trainer",
            "--quick",
            "--json",
            "--export-python",
            sys.executable,
            "--bundle-dir",
            str(tmp_path / "export"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "loader / npz" in proc.stdout
    for k in ("npz", "loader"):
        assert positive(r["median_wall_us"][k]) and positive(r["median_cpu_us"][k])
        assert len(r["wall_samples_us"][k]) == r["rounds"]
    assert r["ratio_wall"] == pytest.approx(
        r["median_wall_us"]["loader"] / r["median_wall_us"]["npz"], rel=1e-2
    )
    warm = 2 * r["steps_per_block"]  # one warm-up block per source
    assert r["step_count"] == warm + 2 * r["rounds"] * r["steps_per_block"]


def test_soak_on_disk_quick() -> None:
    """``soak.py --on-disk``, tiny: many epochs of a dataset folder, memory sampled."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "soak.py"),
            "--on-disk",
            "--steps",
            "600",
            "--warmup",
            "50",
            "--sample-every",
            "100",
            "--rows",
            "400",
            "--rows-per-shard",
            "100",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode in (0, 1), proc.stderr[-5000:]
    r = json.loads(proc.stdout)
    assert r["source"] == "dataset" and r["losses_finite"]
    assert r["step_count"] == 650 and len(r["samples"]) == 6
    assert r["epochs"] >= 10  # 650 steps of batch 8 over 400 rows: 13 epochs
    assert [s[0] for s in r["samples"]] == [100, 200, 300, 400, 500, 600]
    for k in ("anon_first_kb", "anon_last_kb", "anon_max_kb", "rss_max_kb", "steps_per_second"):
        assert positive(r[k]), (k, r[k])
    assert isinstance(r["flat"], bool)
