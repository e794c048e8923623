"""Soak: many steps of a small model in one process, and how the resident memory moves.

    .venv-lean/bin/python benchmarks/soak.py                    # 10,000 steps of dropout_sgd
    .venv-lean/bin/python benchmarks/soak.py --steps 2000 --via-run --json

Loads a golden bundle, runs ``--steps`` training steps (``trainer.step`` in a loop, the
metrics dropped; every ``--sync-every`` steps the loss is read, which waits for the step)
and reports the resident set size (VmRSS in /proc/self/status) after loading, after a
warm-up, and at the end, with the time taken. ``--via-run`` uses ``Trainer.run`` instead,
which keeps every step's metrics in the list it returns: the difference is that list.

No torch: runs in the lean environment. The test suite runs a short version
(tests/runtime/test_hostile_soak.py), which bounds the growth.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The newest format version's golden bundles (one folder per version, v<major>.<minor>).
GOLDEN = max(
    (ROOT / "tests" / "golden").glob("v*.*"),
    key=lambda p: tuple(int(x) for x in p.name[1:].split(".")),
)


def rss_bytes() -> int:
    """The process's resident set size now (Linux: VmRSS in /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status; the soak needs Linux")


def batches(name: str) -> list[dict[str, Any]]:
    import numpy as np

    from stepbundle.runtime.batches import iter_batches

    with np.load(GOLDEN / f"{name}.inputs.npz", allow_pickle=False) as z:
        return iter_batches({k: z[k] for k in z.files})


def soak(
    name: str = "dropout_sgd",
    steps: int = 10_000,
    warmup: int = 500,
    sync_every: int = 100,
    via_run: bool = False,
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """Run the soak and return its figures (bytes and seconds)."""
    from stepbundle.runtime import load

    rss_start = rss_bytes()
    trainer = load(GOLDEN / f"{name}.stepbundle", cache_dir=cache_dir or False)
    data = batches(name)
    n = len(data)
    rss_loaded = rss_bytes()

    for i in range(warmup):
        metrics = trainer.step(data[i % n])
    float(metrics["loss"])
    rss_warm = rss_bytes()

    t0 = time.perf_counter()
    losses_finite = True
    if via_run:
        kept = trainer.run(data, steps)
        losses_finite = math.isfinite(float(kept[-1]["loss"]))
    else:
        kept = None
        for i in range(steps):
            metrics = trainer.step(data[i % n])
            if (i + 1) % sync_every == 0:
                # Reading the loss waits for the step: dispatch never runs far ahead.
                losses_finite = losses_finite and math.isfinite(float(metrics["loss"]))
        del metrics
    trainer.block_until_ready()
    seconds = time.perf_counter() - t0
    rss_end = rss_bytes()
    del kept
    return {
        "bundle": name,
        "steps": steps,
        "warmup_steps": warmup,
        "via": "Trainer.run" if via_run else "Trainer.step",
        "seconds": seconds,
        "steps_per_second": steps / seconds,
        "rss_start": rss_start,
        "rss_after_load": rss_loaded,
        "rss_after_warmup": rss_warm,
        "rss_end": rss_end,
        "growth_after_warmup": rss_end - rss_warm,
        "losses_finite": losses_finite,
        "step_count": trainer.step_count,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default="dropout_sgd", help="golden bundle name")
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--sync-every", type=int, default=100)
    p.add_argument("--via-run", action="store_true", help="use Trainer.run (keeps metrics)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    r = soak(args.bundle, args.steps, args.warmup, args.sync_every, args.via_run)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        mib = 1024 * 1024
        print(
            f"soak: {r['steps']} steps of {r['bundle']} via {r['via']} in {r['seconds']:.1f} s "
            f"({r['steps_per_second']:.0f} steps/s), after {r['warmup_steps']} warm-up steps"
        )
        print(f"  RSS at start        {r['rss_start'] / mib:8.1f} MiB  (runtime imported)")
        print(f"  RSS after load      {r['rss_after_load'] / mib:8.1f} MiB")
        print(f"  RSS after warm-up   {r['rss_after_warmup'] / mib:8.1f} MiB")
        print(f"  RSS at the end      {r['rss_end'] / mib:8.1f} MiB")
        print(f"  growth after warm-up {r['growth_after_warmup'] / mib:+7.1f} MiB")  # fmt: skip
    return 0 if r["losses_finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
