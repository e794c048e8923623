"""Fused attention on the device against the CPU: losses and state over a few steps.

    # here: a bundle of tests/exporter/test_fused_attention.py's model, and the CPU's
    # numbers for it (the runtime on the CPU, traced attention), with torch_xla
    .venv/bin/python benchmarks/device/attention_check.py prepare build/tpu/attn
    # on the device machine (no torch)
    python benchmarks/device/attention_check.py check build/tpu/attn --out attn.json

``check`` loads the bundle three ways on the device at the default precision: fused
attention (the default on a TPU) one step per call, fused with 4 steps per call (the
step inside a loop), and with ``fused_attention=False``; runs the same 8 steps on each
and reports each one's losses against the CPU's, the largest state difference, and
whether the 4-per-call run is bit for bit the single steps.

Imports: numpy, stepbundle.runtime (``check``); torch and stepbundle.exporter (``prepare``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions

STEPS = 8


def prepare(folder: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "exporter"))
    import test_fused_attention as t  # the test's model and step: one definition

    from stepbundle.runtime import load

    folder.mkdir(parents=True, exist_ok=True)
    path, _ = t._export(folder, causal=True)
    rng = np.random.default_rng(7)
    batches = [
        {k: rng.integers(0, t.VOCAB, (t.BATCH, t.T)).astype(np.int64) for k in ("idx", "y")}
        for _ in range(STEPS)
    ]
    trainer = load(
        path,
        device="cpu",
        options=LoadOptions(compile=CompileOptions(entries="train", cache_dir=False)),
    )
    losses = [float(trainer.step(b)["loss"]) for b in batches]
    state = {k: np.asarray(v) for k, v in trainer.state_dict().items()}
    np.savez(folder / "batches.npz", **{f"{k}{i}": b[k] for i, b in enumerate(batches) for k in b})
    np.savez(folder / "cpu_state.npz", **state)
    (folder / "cpu.json").write_text(json.dumps({"losses": losses}))
    print(f"wrote {path} and the CPU's numbers: losses {losses[0]:.6f} .. {losses[-1]:.6f}")


def check(folder: Path, out: str | None, device: str = "tpu") -> int:
    import jax

    from stepbundle.runtime import load
    from stepbundle.runtime.options import LoadOptions

    raw = np.load(folder / "batches.npz")
    batches = [{k: raw[f"{k}{i}"] for k in ("idx", "y")} for i in range(STEPS)]
    cpu = json.loads((folder / "cpu.json").read_text())["losses"]
    cpu_state = dict(np.load(folder / "cpu_state.npz"))
    report: dict[str, Any] = {"jax": jax.__version__, "cpu_losses": cpu}

    def run(fused: bool, k: int) -> tuple[list[float], dict[str, np.ndarray], float]:
        opts = LoadOptions.from_keywords(cache_dir=False, entry="train", steps_per_call=k)
        opts = replace(opts, compile=replace(opts.compile, fused_attention=fused))
        trainer = load(folder / "attn.stepbundle", device=device, options=opts)
        if k == 1:
            losses = [float(trainer.step(b)["loss"]) for b in batches]
        else:
            losses = []
            for i in range(0, STEPS, k):
                stack = {n: np.stack([b[n] for b in batches[i : i + k]]) for n in ("idx", "y")}
                losses += [float(x) for x in np.asarray(trainer.step_many(stack)["loss"])]
        state = {n: np.asarray(v) for n, v in trainer.state_dict().items()}
        return losses, state, float(trainer.load_info.seconds["compile"])

    runs = {}
    for name, fused, k in (("fused", True, 1), ("fused_k4", True, 4), ("traced", False, 1)):
        losses, state, compile_s = run(fused, k)
        runs[name] = (losses, state)
        gap = max(
            float(np.max(np.abs(state[n].astype(np.float64) - cpu_state[n])))
            / (float(np.max(np.abs(cpu_state[n]))) or 1.0)
            for n in cpu_state
        )
        report[name] = {
            "losses": losses,
            "max_abs_loss_vs_cpu": float(np.max(np.abs(np.subtract(losses, cpu)))),
            "max_rel_state_vs_cpu": gap,
            "compile_s": compile_s,
        }
        print(
            f"{name:9s} losses vs CPU {report[name]['max_abs_loss_vs_cpu']:.2e}, "
            f"state {gap:.2e}, compile {compile_s:.1f}s",
            flush=True,
        )
    same = runs["fused"][0] == runs["fused_k4"][0] and all(
        np.array_equal(runs["fused"][1][n], runs["fused_k4"][1][n]) for n in cpu_state
    )
    report["fused_k4_bit_for_bit"] = same
    print(f"4 steps per call bit for bit the single steps: {same}", flush=True)
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare").add_argument("folder")
    c = sub.add_parser("check")
    c.add_argument("folder")
    c.add_argument("--out", default=None)
    c.add_argument("--device", default="tpu")
    a = p.parse_args()
    if a.cmd == "prepare":
        prepare(Path(a.folder))
        return 0
    return check(Path(a.folder), a.out, a.device)


if __name__ == "__main__":
    raise SystemExit(main())
