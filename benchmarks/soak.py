"""Soak: many steps of a small model in one process, and how the resident memory moves.

    .venv-lean/bin/python benchmarks/soak.py                    # 10,000 steps of dropout_sgd
    .venv-lean/bin/python benchmarks/soak.py --steps 2000 --via-run --json

Loads a golden bundle, runs ``--steps`` training steps (``trainer.step`` in a loop, the
metrics dropped; every ``--sync-every`` steps the loss is read, which waits for the step)
and reports the resident set size (VmRSS in /proc/self/status) after loading, after a
warm-up, and at the end, with the time taken. ``--via-run`` uses ``Trainer.run`` instead,
which keeps every step's metrics in the list it returns: the difference is that list.

**On-disk data** (``--on-disk``): the same, but the batches come from a dataset folder
(``runtime/data/dataset.py``) through a shuffled ``Loader`` running over many epochs, stepped
by ``Trainer.run(loader, steps, keep_metrics=False)``::

    .venv-lean/bin/python benchmarks/soak.py --on-disk                  # 100,000 steps of linear_adamw

The folder (``--rows`` rows in shards of ``--rows-per-shard``, so a batch touches
several shards) is written to a temporary folder from the golden inputs' rows, drawn
with replacement (every row a real example of the bundle's shapes and dtypes). Every
``--sample-every`` steps the loss is read (which waits for the step) and three figures
are taken from /proc/self/status: VmRSS, RssAnon (private, anonymous memory: what would
grow if something leaked) and RssFile (file pages mapped in, the dataset's memory maps
among them: page cache, which the kernel reclaims under pressure, and which rises to
the dataset's size after one epoch by design). ``--control`` runs the same sampled
loop over the in-memory golden batches, for comparison. "Flat" means the anonymous memory after
the warm-up does not grow: last minus first sample, and max minus first, both under
``GROWTH_LIMIT`` (4 MiB, as in the test), plus the least-squares slope over the samples.

No torch: runs in the lean environment. The test suite runs a short version
(tests/runtime/test_hostile_soak.py), which bounds the growth.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stepbundle.runtime import CompileOptions, LoadOptions

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


GROWTH_LIMIT = 4 * 1024 * 1024  # bytes; what "flat" allows (tests/runtime/test_hostile_soak.py)


def memory_kb() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile now, in KiB (Linux: /proc/self/status)."""
    want = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
    got: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in want:
                got[want[key]] = int(line.split()[1])
    if len(got) != len(want):
        raise RuntimeError(f"/proc/self/status lacks {sorted(set(want) - set(got))}; needs Linux")
    return got


def batches(name: str) -> list[dict[str, Any]]:
    import numpy as np

    from stepbundle.runtime.train.batches import iter_batches

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
    trainer = load(
        GOLDEN / f"{name}.stepbundle",
        options=LoadOptions(compile=CompileOptions(cache_dir=cache_dir or False)),
    )
    data = batches(name)
    n = len(data)
    rss_loaded = rss_bytes()

    for i in range(warmup):
        metrics = trainer.step(data[i % n])
    float(metrics["loss"])
    rss_warm = rss_bytes()

    t0 = time.perf_counter()
    losses_finite = True
    rss_mid = None  # half way through (Trainer.step only)
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
            if i + 1 == steps // 2:
                float(metrics["loss"])
                rss_mid = rss_bytes()
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
        # Each half's growth (Trainer.step only): a leak grows both, a one-off allocation
        # (an allocator arena, a library page touched late) one.
        "growth_halves": None if rss_mid is None else [rss_mid - rss_warm, rss_end - rss_mid],
        "losses_finite": losses_finite,
        "step_count": trainer.step_count,
    }


class Source(enum.Enum):
    """Where ``soak_sampled``'s batches come from."""

    DATASET = "dataset"
    """A shuffled ``Loader`` over a dataset folder (the on-disk path)."""
    NPZ = "npz"
    """The golden inputs' batches in memory (the ``--data x.npz`` path): the control."""


def _slope(xs: list[int], ys: list[int]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0 for fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def soak_sampled(
    name: str = "linear_adamw",
    source: Source = Source.DATASET,
    steps: int = 100_000,
    warmup: int = 1_000,
    sample_every: int = 1_000,
    rows: int = 40_000,
    rows_per_shard: int = 5_000,
    seed: int = 0,
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """Step ``name`` from ``source`` with ``Trainer.run``, sampling memory as it goes.

    Returns the figures (KiB and seconds) and every sample ``[step, rss, anon, file]``.
    """
    import numpy as np

    from stepbundle.runtime import load
    from stepbundle.runtime.data.dataset import open_dataset
    from stepbundle.runtime.data.dataset_writer import write_dataset
    from stepbundle.runtime.data.loader import Loader

    mem_start = memory_kb()
    with np.load(GOLDEN / f"{name}.inputs.npz", allow_pickle=False) as z:
        stacked = {k: z[k] for k in z.files}
    batch_size = next(iter(stacked.values())).shape[1]
    golden_rows = {k: v.reshape(-1, *v.shape[2:]) for k, v in stacked.items()}
    n_golden = next(iter(golden_rows.values())).shape[0]
    pick = np.random.default_rng(seed).integers(0, n_golden, rows)
    with tempfile.TemporaryDirectory() as tmp:
        folder = f"{tmp}/data"
        write_dataset(
            folder, {k: v[pick] for k, v in golden_rows.items()}, rows_per_shard=rows_per_shard
        )
        del pick
        ds = open_dataset(folder)
        loader = Loader(ds, batch_size, seed=seed)
        feed: Any = loader if source is Source.DATASET else batches(name)
        trainer = load(
            GOLDEN / f"{name}.stepbundle",
            options=LoadOptions(compile=CompileOptions(cache_dir=cache_dir or False)),
        )
        mem_loaded = memory_kb()
        float(trainer.run(feed, warmup, keep_metrics=False)[-1]["loss"])
        mem_warm = memory_kb()

        # Preallocated, so that keeping the samples allocates nothing during the run
        # (a growing list of Python ints alone would add ~20 KiB of "growth").
        table = np.zeros((steps // sample_every, 4), dtype=np.int64)
        taken = [0]
        finite = [True]

        def on_step(i: int, metrics: dict[str, Any]) -> None:
            if (i + 1) % sample_every == 0:
                # Reading the loss waits for the step: dispatch never runs far ahead.
                finite[0] = finite[0] and math.isfinite(float(metrics["loss"]))
                m = memory_kb()
                table[taken[0]] = (i + 1, m["rss"], m["anon"], m["file"])
                taken[0] += 1

        t0 = time.perf_counter()
        last = trainer.run(feed, steps, on_step, keep_metrics=False)
        finite[0] = finite[0] and math.isfinite(float(last[-1]["loss"]))
        seconds = time.perf_counter() - t0
        mem_end = memory_kb()
        position = loader.state()
        dataset_bytes = sum(f.size - f.offset for files in ds.files.values() for f in files)
        step_count = trainer.step_count
        del trainer, loader, feed, ds, last
    samples = table[: taken[0]].tolist()
    anon = [s[2] for s in samples]
    rss = [s[1] for s in samples]
    first, final = samples[0], samples[-1]
    slope = _slope([s[0] for s in samples], anon) * 1000  # KiB per 1000 steps
    growth_kb = final[2] - first[2]
    max_over_kb = max(anon) - first[2]
    return {
        "bundle": name,
        "source": source.value,
        "steps": steps,
        "warmup_steps": warmup,
        "sample_every": sample_every,
        "dataset_rows": rows,
        "rows_per_shard": rows_per_shard,
        "dataset_bytes": dataset_bytes,
        "batch_size": batch_size,
        "epochs": position["epoch"] if source is Source.DATASET else None,
        "data_position": position if source is Source.DATASET else None,
        "seconds": seconds,
        "steps_per_second": steps / seconds,
        "kb_start": mem_start,
        "kb_after_load": mem_loaded,
        "kb_after_warmup": mem_warm,
        "kb_end": mem_end,
        "anon_first_kb": first[2],
        "anon_last_kb": final[2],
        "anon_max_kb": max(anon),
        "anon_growth_kb": growth_kb,
        "anon_max_over_first_kb": max_over_kb,
        "anon_slope_kb_per_1000_steps": slope,
        "rss_first_kb": first[1],
        "rss_last_kb": final[1],
        "rss_max_kb": max(rss),
        "file_first_kb": first[3],
        "file_last_kb": final[3],
        "flat": growth_kb * 1024 < GROWTH_LIMIT and max_over_kb * 1024 < GROWTH_LIMIT,
        "losses_finite": finite[0],
        "step_count": step_count,
        "samples": samples,
    }


def print_sampled(r: dict[str, Any]) -> None:
    mib = 1024
    if r["source"] == Source.DATASET.value:
        where = (
            f"from a Loader over {r['dataset_rows']} rows in shards of {r['rows_per_shard']} "
            f"({r['dataset_bytes'] / 1024:.0f} KiB), {r['epochs']} epochs,"
        )
    else:
        where = "from the in-memory golden batches (control),"
    print(
        f"soak ({r['source']}): {r['steps']} steps of {r['bundle']} (batch {r['batch_size']}) "
        f"{where} in {r['seconds']:.1f} s ({r['steps_per_second']:.0f} steps/s), after "
        f"{r['warmup_steps']} warm-up steps"
    )
    print(f"{'':22}{'VmRSS':>10}{'RssAnon':>10}{'RssFile':>10}  (MiB)")
    rows = [
        ("start", r["kb_start"]),
        ("after load", r["kb_after_load"]),
        ("after warm-up", r["kb_after_warmup"]),
        ("end", r["kb_end"]),
    ]
    for label, m in rows:
        print(
            f"  {label:<20}{m['rss'] / mib:>10.1f}{m['anon'] / mib:>10.1f}{m['file'] / mib:>10.1f}"
        )
    print(
        f"  samples every {r['sample_every']} steps ({len(r['samples'])}): RssAnon first "
        f"{r['anon_first_kb'] / mib:.2f} MiB, last {r['anon_last_kb'] / mib:.2f}, max "
        f"{r['anon_max_kb'] / mib:.2f} (growth {r['anon_growth_kb']:+d} KiB, max over first "
        f"{r['anon_max_over_first_kb']:+d} KiB, slope "
        f"{r['anon_slope_kb_per_1000_steps']:+.2f} KiB/1000 steps); VmRSS first "
        f"{r['rss_first_kb'] / mib:.2f}, last {r['rss_last_kb'] / mib:.2f}, max "
        f"{r['rss_max_kb'] / mib:.2f} MiB"
    )
    print(f"  flat (anonymous growth and peak < {GROWTH_LIMIT // 1024} KiB): {r['flat']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", help="golden bundle name (dropout_sgd; --on-disk: linear_adamw)")
    p.add_argument("--steps", type=int, help="steps after warm-up (10,000; --on-disk: 100,000)")
    p.add_argument("--warmup", type=int, help="warm-up steps (500; --on-disk: 1,000)")
    p.add_argument("--sync-every", type=int, default=100)
    p.add_argument("--via-run", action="store_true", help="use Trainer.run (keeps metrics)")
    p.add_argument("--on-disk", action="store_true", help="batches from a dataset folder")
    p.add_argument("--control", action="store_true", help="as --on-disk, but the in-memory batches")
    p.add_argument("--rows", type=int, default=40_000, help="--on-disk: dataset rows")
    p.add_argument("--rows-per-shard", type=int, default=5_000, help="--on-disk: shard size")
    p.add_argument("--sample-every", type=int, default=1_000, help="--on-disk: steps per sample")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args()
    if args.on_disk or args.control:
        d = soak_sampled(
            args.bundle or "linear_adamw",
            Source.NPZ if args.control else Source.DATASET,
            args.steps or 100_000,
            1_000 if args.warmup is None else args.warmup,
            args.sample_every,
            args.rows,
            args.rows_per_shard,
        )
        print(json.dumps(d, indent=2)) if args.json else print_sampled(d)
        return 0 if d["losses_finite"] and d["flat"] else 1
    args.bundle = args.bundle or "dropout_sgd"
    args.steps = args.steps or 10_000
    args.warmup = 500 if args.warmup is None else args.warmup
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
