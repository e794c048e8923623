"""Bundles without weights: their size, and host memory while loading from a checkpoint.

Exports a wide MLP (``models.wide_mlp``, AdamW) twice, with its state and without
(``Recipe(include_state=False)``), saves its weights as a safetensors file the way a
PyTorch user would (``safetensors.torch.save_file(model.state_dict())``), and then, in
fresh processes of the lean environment (no torch), loads the full bundle and the
weights-free bundle from that file, interleaved round by round in alternating order so
that load noise hits both alike. Each child reports its resident memory
(``init_from_child.py``).

The figure that matters is the host memory the placement of the state takes beyond the
process's baseline: ``VmHWM`` during ``place_state`` minus ``VmRSS`` just before it,
minus the bytes the state then holds on the device. On the CPU backend the device *is*
host memory, so those bytes are resident too and are subtracted; on a GPU they would not
be in host RSS at all. The whole load (compile-cache read included) is reported beside it.

Usage::

    .venv/bin/python benchmarks/init_from.py                  # depth 12: 201 MB of weights
    .venv/bin/python benchmarks/init_from.py --depth 2 --rounds 2 --out build/init_from.md

Imports: torch and the exporter (to build the bundles); the children import the runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("PJRT_DEVICE", "CPU")

WIDTH = 2048
BATCH = 8
MB = 1e6


def build(work: Path, depth: int) -> dict[str, Any]:
    """Export both bundles and write the weights file; return their paths and sizes."""
    import torch_xla

    torch_xla.device()
    import models
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from stepbundle.exporter import Recipe, export

    def recipe(include_state: bool) -> Recipe:
        torch.manual_seed(0)
        model = models.wide_mlp(WIDTH, depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True, foreach=False)
        g = torch.Generator().manual_seed(1)
        example = {"x": torch.randn(BATCH, WIDTH, generator=g), "y": torch.randn(BATCH, WIDTH)}
        return Recipe(model, opt, models.mse_step, example, include_state=include_state)

    out: dict[str, Any] = {"depth": depth}
    t0 = time.perf_counter()
    full = export(recipe(True), work / "full.stepbundle")
    out["export_full_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    free = export(recipe(False), work / "free.stepbundle")
    out["export_free_s"] = time.perf_counter() - t0
    r = recipe(True)
    weights = work / "model.safetensors"
    save_file({k: v.contiguous() for k, v in r.model.state_dict().items()}, weights)
    np.savez(work / "batch.npz", **{k: v.numpy() for k, v in r.example_batch.items()})
    out["full_bytes"] = full.size
    out["free_bytes"] = free.size
    out["weights_bytes"] = weights.stat().st_size
    out["state_bytes"] = sum(s.spec.nbytes for s in full.manifest.state)
    out["state_tensors"] = len(full.manifest.state)
    out["largest_bytes"] = max(s.spec.nbytes for s in full.manifest.state)
    return out


def child(python: str, args: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [python, str(HERE / "init_from_child.py"), *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def figures(run: dict[str, Any]) -> dict[str, float]:
    """MB of host memory beyond the baseline, from one child's report."""
    p = run["placement"]
    state = run["state_bytes"] / MB
    place_peak = (p["after"]["VmHWM"] - p["before"]["VmRSS"]) * 1e3 / MB - state
    load_peak_kb = max(p["before"]["VmHWM"], p["after"]["VmHWM"])
    load_peak = (load_peak_kb - run["before_load"]["VmRSS"]) * 1e3 / MB - state
    kept = (run["after_load"]["VmRSS"] - run["before_load"]["VmRSS"]) * 1e3 / MB - state
    return {
        "placement_extra_mb": place_peak,
        "load_extra_mb": load_peak,
        "kept_extra_mb": kept,
        "file_after_load_mb": run["after_load"]["RssFile"] * 1e3 / MB,
        "placement_s": p["seconds"],
        "load_s": run["load_s"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=12, help="Linear(2048, 2048) layers (12: 201 MB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "init_from.md"))
    args = ap.parse_args(argv)
    lean = ROOT / ".venv-lean" / "bin" / "python"
    python = str(lean) if lean.exists() else sys.executable
    work = Path(tempfile.mkdtemp(prefix="init_from."))
    try:
        info = build(work, args.depth)
        cache = str(work / "cache")
        batch = str(work / "batch.npz")
        modes = {
            "full bundle": [str(work / "full.stepbundle"), cache, batch],
            "weights-free bundle + init_from": [
                str(work / "free.stepbundle"),
                cache,
                batch,
                str(work / "model.safetensors"),
            ],
        }
        warm = child(python, modes["full bundle"])  # fills the compile cache (one program)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                runs[mode].append(child(python, modes[mode]))
        losses = {run["loss_hex"] for rs in runs.values() for run in rs} | {warm["loss_hex"]}
        info["same_first_loss"] = len(losses) == 1
        info["compiled_in_measured"] = sum(run["compiled"] for rs in runs.values() for run in rs)
        info["peak_reset"] = all(
            run["placement"]["peak_reset"] for rs in runs.values() for run in rs
        )
        table = {
            mode: {k: statistics.median(figures(run)[k] for run in rs) for k in figures(rs[0])}
            for mode, rs in runs.items()
        }
        text = report(info, table, args)
        print(text)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        raw = Path(args.out).with_suffix(".json")
        raw.write_text(json.dumps({"info": info, "runs": runs}, indent=1), encoding="utf-8")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(info: dict[str, Any], table: dict[str, dict[str, float]], args: Any) -> str:
    largest = info["largest_bytes"] / MB
    free = table["weights-free bundle + init_from"]
    full = table["full bundle"]
    lines = [
        "# Bundles without weights: size, and host memory while loading from a checkpoint",
        "",
        f"`.venv/bin/python benchmarks/init_from.py --depth {args.depth} --rounds {args.rounds}`"
        " (benchmarks/init_from.py says how). Model: "
        f"{info['depth']} x (Linear({WIDTH}, {WIDTH}), GELU), AdamW (capturable), batch {BATCH}: "
        f"{info['state_tensors']} state tensors, {info['state_bytes'] / MB:.0f} MB of state "
        "(parameters, kept gradients, both moments), the largest tensor "
        f"{largest:.1f} MB. Medians of {args.rounds} fresh lean processes per bundle, "
        "interleaved; CPU backend, this project's 2-core machine.",
        "",
        "| | bytes | share of the full bundle |",
        "|---|---|---|",
        f"| full bundle | {info['full_bytes']:,} | 100% |",
        f"| weights-free bundle | {info['free_bytes']:,} | "
        f"{100 * info['free_bytes'] / info['full_bytes']:.3f}% |",
        f"| weights file (`save_file(model.state_dict())`) | {info['weights_bytes']:,} | |",
        "",
        "Host memory beyond the baseline, in MB (the state's own bytes on the device, "
        f"{info['state_bytes'] / MB:.0f} MB, subtracted: on the CPU backend they are host "
        "memory too):",
        "",
        "| | placing the state: peak | whole load: peak | kept after load | "
        "file pages after load | placing the state | whole load |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, row in table.items():
        lines.append(
            f"| {mode} | {row['placement_extra_mb']:.1f} "
            f"({row['placement_extra_mb'] / largest:.2f}x largest) | "
            f"{row['load_extra_mb']:.1f} | {row['kept_extra_mb']:.1f} | "
            f"{row['file_after_load_mb']:.1f} | {row['placement_s']:.2f} s | {row['load_s']:.2f} s |"
        )
    lines += [
        "",
        f"Placing the state from the weights file took {free['placement_extra_mb'] / largest:.2f}x "
        f"the largest tensor beyond the baseline, against "
        f"{full['placement_extra_mb'] / largest:.2f}x for the full bundle, whose every "
        "section is mapped and read (digest, then copy) before the mapping is released. "
        "Peak = VmHWM while `place_state` runs minus VmRSS just before it"
        + ("" if info["peak_reset"] else " (VmHWM could not be reset here: an upper bound)")
        + "; whole load = from before `load()`, compile-cache read and executable included. "
        f"First losses bit-identical across every process: {info['same_first_loss']}; "
        f"programs compiled in the measured processes: {info['compiled_in_measured']} "
        "(all from the compile cache).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
