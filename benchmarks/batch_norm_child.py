"""The timing half of ``batch_norm.py``, in the lean environment (no torch).

Usage: python batch_norm_child.py REWRITE.stepbundle TORCH_XLA.stepbundle BATCH.npz ROUNDS TARGET_S

Prints one JSON line: each bundle's per-round ms per step, wall and CPU (every thread of
the process: on a shared machine much less noisy than wall time), their medians, the
ratios of the medians, and the median of the per-round wall ratios.

Imports: the runtime, numpy.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions


def _block(trainer: Any, batch: dict[str, Any], k: int) -> tuple[float, float]:
    """Wall and CPU seconds (every thread of this process) of k steps."""
    t, c = time.perf_counter(), time.process_time()
    for _ in range(k):
        m = trainer.step(batch)
    float(np.asarray(m["loss"]))
    return time.perf_counter() - t, time.process_time() - c


def main(argv: list[str]) -> int:
    import jax

    from stepbundle.runtime import load

    rewrite, torch_xla, batch_path, rounds_s, target_s = argv
    with np.load(batch_path, allow_pickle=False) as z:
        batch = {k: z[k] for k in z.files}
    trainers = {
        "pytorch": load(rewrite, options=LoadOptions(compile=CompileOptions(cache_dir=False))),
        "torch_xla": load(torch_xla, options=LoadOptions(compile=CompileOptions(cache_dir=False))),
    }
    ks = {}
    for name, tr in trainers.items():
        _block(tr, batch, 3)  # compile and warm up
        per_step = _block(tr, batch, 3)[0] / 3
        ks[name] = max(1, round(float(target_s) / per_step))
    k = min(ks.values())  # one block size for both: the same work per sample
    wall: dict[str, list[float]] = {n: [] for n in trainers}
    cpu: dict[str, list[float]] = {n: [] for n in trainers}
    for r in range(int(rounds_s)):
        order = list(trainers) if r % 2 == 0 else list(reversed(trainers))
        for name in order:
            w, c = _block(trainers[name], batch, k)
            wall[name].append(1e3 * w / k)
            cpu[name].append(1e3 * c / k)
    out: dict[str, Any] = {"jax": jax.__version__, "steps_per_block": k}
    for name in trainers:
        out[name] = {
            "median_ms": statistics.median(wall[name]),
            "cpu_median_ms": statistics.median(cpu[name]),
            "samples_ms": wall[name],
            "cpu_samples_ms": cpu[name],
        }
    out["ratio"] = out["pytorch"]["median_ms"] / out["torch_xla"]["median_ms"]
    out["cpu_ratio"] = out["pytorch"]["cpu_median_ms"] / out["torch_xla"]["cpu_median_ms"]
    out["ratio_of_rounds"] = statistics.median(
        a / b for a, b in zip(wall["pytorch"], wall["torch_xla"])
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
