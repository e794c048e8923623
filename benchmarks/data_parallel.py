"""Data parallelism on virtual CPU devices: memory per device, agreement, step time.

One export of a GPT, then the same bundle loaded on 1, 2 and 4 devices, and on 4 with
the optimizer state split over them (ZeRO-1). Printed side by side, from one run:

- training-state bytes resident on each device (the figure ZeRO-1 changes);
- the largest relative difference of the losses, and the largest normwise relative
  difference of any final state tensor, from the one-device run;
- median step time, interleaved rounds. The virtual devices of this machine share its
  two cores, so these times show the cost of partitioning, not a speed-up.

Usage: .venv/bin/python benchmarks/data_parallel.py [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 4)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import Case, GPTConfig, make_batches, recipe  # noqa: E402

from stepbundle.runtime import LoadOptions  # noqa: E402

CONFIGS = (
    ("1 device", {"devices": 1}),
    ("2 devices", {"devices": 2}),
    ("4 devices", {"devices": 4}),
    ("4 devices, ZeRO-1", {"devices": 4, "shard_optimizer_state": True}),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "data_parallel.md"))
    args = ap.parse_args()

    import torch_xla

    torch_xla.device()
    from stepbundle.exporter import export
    from stepbundle.runtime import load

    case = Case("gpt", 4, GPTConfig(vocab=512, block=32, layers=4, width=128, batch=16))
    batches = make_batches(case, 4)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt.stepbundle"
        export(recipe(case, batches[0]), path)
        trainers = {
            label: load(path, options=LoadOptions.from_keywords(cache_dir=False, **kw))
            for label, kw in CONFIGS
        }
    results: dict[str, dict[str, object]] = {}
    for label, t in trainers.items():
        ms = t.run(batches, args.steps)
        results[label] = {
            "losses": np.array([float(m["loss"]) for m in ms]),
            "state": t.state_dict(),
            "bytes": max(t.state_bytes_per_device().values()),
            "times": [],
        }
    ref = results["1 device"]
    for _ in range(args.rounds):
        for label, t in trainers.items():
            t.block_until_ready()
            t0 = time.perf_counter()
            t.run(batches, args.steps, keep_metrics=False)
            t.block_until_ready()
            times = results[label]["times"]
            assert isinstance(times, list)
            times.append((time.perf_counter() - t0) / args.steps * 1e3)

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-6))

    def normwise(a: np.ndarray, b: np.ndarray) -> float:
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a64 - b64) / max(float(np.linalg.norm(b64)), 1e-6))

    lines = [
        f"GPT (vocab 512, width 128, 4 layers, batch 16), AdamW, {args.steps} steps; "
        f"jax {jax.__version__}, virtual CPU devices sharing 2 cores.",
        "",
        "| run | state bytes per device | vs 1 device | losses vs 1 device | state vs 1 device "
        "(normwise, worst tensor) | step (median ms) |",
        "|---|---|---|---|---|---|",
    ]
    base_bytes = int(ref["bytes"])  # type: ignore[call-overload]
    for label, r in results.items():
        state = r["state"]
        assert isinstance(state, dict)
        ref_state = ref["state"]
        assert isinstance(ref_state, dict)
        d_state = max(normwise(state[k], ref_state[k]) for k in ref_state)
        d_loss = rel(r["losses"], ref["losses"])  # type: ignore[arg-type]
        nbytes = int(r["bytes"])  # type: ignore[call-overload]
        times = r["times"]
        assert isinstance(times, list)
        lines.append(
            f"| {label} | {nbytes / 2**20:.2f} MiB | {nbytes / base_bytes:.2f}x | {d_loss:.1e} "
            f"| {d_state:.1e} | {statistics.median(times):.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
