"""Time per batch of the on-disk loader vs the in-memory ``.npz`` path (and, optionally, grain).

The batch is MLP depth 32's (``benchmarks/models.py``): ``x`` and ``y``, 32 x 16
float32. A dataset of ``--rows`` rows is written to a temporary folder in the on-disk
layout (``runtime/dataset.py``) and read back warm (in the page cache, as after the first
epoch). Methods, each producing one batch per call:

- ``npz``: the current ``--data x.npz`` path: the file's stacked batches split once by
  ``runtime.batches.iter_batches``, then ``batches[i % S]`` (no shuffling at all).
- ``memory_shuffled``: the same rows as in-memory arrays, one fancy index per input by
  a slice of a fresh per-epoch permutation (what shuffling in memory costs).
- ``loader``: ``runtime.loader.Loader`` over the on-disk dataset, shuffled.
- ``loader_in_order``: the same with ``shuffle=False`` (contiguous slices).
- ``loader_8_shards``: shuffled, the rows split over 8 shards (the default shard size
  puts them in one), so a batch touches ~8 shards: one ``take`` per input per shard.
- with ``--grain`` (run under a Python with grain installed, e.g. a scratch venv:
  ``python3 -m venv /tmp/grainenv && /tmp/grainenv/bin/pip install grain numpy``):
  ``grain_rows``, grain's idiomatic ``MapDataset.source(rows).shuffle().repeat()
  .batch(32)`` iterator over the same memory maps, and ``grain_index``, grain used as
  an index generator only (``MapDataset.range(n)...batch(32).map(dataset.gather)``).
  It also checks that grain's ``get_state``/``set_state`` resume exactly.

Rounds are interleaved (the order rotates each round) and the figure is the median over
rounds of one block's time / batches. The ratio ``loader / npz`` is printed; the issue's
budget is the whole step within 1.10x of the ``.npz`` path at MLP depth 32, whose step
takes about 1.07 ms (``benchmarks/results/results.md``), so about 100 us of un-overlapped
data time per step. (The lead measures step time with the trainer.)

Run: ``.venv/bin/python benchmarks/data_pipeline.py [--rows N] [--rounds R]``.

Imports: numpy, stepbundle.runtime's data modules (and grain with ``--grain``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 32
WIDTH = 16
ROOT = Path(__file__).resolve().parent.parent


def _import_data_modules() -> tuple[Any, Any, Any]:
    """``dataset``, ``dataset_writer``, ``loader`` from ``stepbundle.runtime``.

    In a Python without jax (grain's scratch venv), ``stepbundle.runtime``'s package
    ``__init__`` cannot be imported (it imports jax), so the three numpy-only modules
    are loaded from the checkout under stand-in packages instead.
    """
    try:
        from stepbundle.runtime import dataset, dataset_writer, loader

        return dataset, dataset_writer, loader
    except ImportError:
        pass
    for name, folder in (
        ("stepbundle", ROOT / "package"),
        ("stepbundle.schema", ROOT / "schema"),
        ("stepbundle.runtime", ROOT / "runtime"),
    ):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(folder)]
        sys.modules[name] = pkg
    for mod in (
        "schema.errors",
        "schema.atomic",
        "runtime.errors",
        "runtime.dataset",
        "runtime.dataset_writer",
        "runtime.loader",
    ):
        full = f"stepbundle.{mod}"
        spec = importlib.util.spec_from_file_location(full, ROOT / (mod.replace(".", "/") + ".py"))
        assert spec is not None and spec.loader is not None
        m = importlib.util.module_from_spec(spec)
        sys.modules[full] = m
        spec.loader.exec_module(m)
    return (
        sys.modules["stepbundle.runtime.dataset"],
        sys.modules["stepbundle.runtime.dataset_writer"],
        sys.modules["stepbundle.runtime.loader"],
    )


def _iter_batches(data: dict[str, np.ndarray[Any, Any]]) -> list[dict[str, np.ndarray[Any, Any]]]:
    try:
        from stepbundle.runtime.batches import iter_batches

        return iter_batches(data)
    except ImportError:  # no jax: the same split, written out (runtime/batches.py)
        s = next(iter(data.values())).shape[0]
        return [{k: np.asarray(v[i], order="C") for k, v in data.items()} for i in range(s)]


def methods(
    rows: int, folder: str, with_grain: bool
) -> dict[str, Callable[[], dict[str, np.ndarray[Any, Any]]]]:
    dataset_mod, writer_mod, loader_mod = _import_data_modules()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, WIDTH), dtype=np.float32)
    y = rng.standard_normal((rows, WIDTH), dtype=np.float32)
    writer_mod.write_dataset(folder, {"x": x, "y": y})  # default shards: one, here
    ds = dataset_mod.open_dataset(folder)
    writer_mod.write_dataset(folder + "8", {"x": x, "y": y}, rows_per_shard=-(-rows // 8))
    ds8 = dataset_mod.open_dataset(folder + "8")
    for d in (ds, ds8):
        for _ in dataset_mod.iter_rows(d):  # warm the page cache
            pass

    s = rows // BATCH
    npz = _iter_batches(
        {"x": x[: s * BATCH].reshape(s, BATCH, WIDTH), "y": y[: s * BATCH].reshape(s, BATCH, WIDTH)}
    )
    counter = {"npz": 0, "mem": 0, "epoch": 0}
    perm = np.random.default_rng([0, 0]).permutation(rows)

    def npz_next() -> dict[str, np.ndarray[Any, Any]]:
        i = counter["npz"]
        counter["npz"] = i + 1
        return npz[i % s]

    def memory_next() -> dict[str, np.ndarray[Any, Any]]:
        nonlocal perm
        i = counter["mem"]
        if i == s:
            counter["epoch"] += 1
            perm = np.random.default_rng([0, counter["epoch"]]).permutation(rows)
            i = 0
        counter["mem"] = i + 1
        idx = perm[i * BATCH : (i + 1) * BATCH]
        return {"x": x[idx], "y": y[idx]}

    shuffled = loader_mod.Loader(ds, BATCH, seed=0)
    in_order = loader_mod.Loader(ds, BATCH, shuffle=False)
    shuffled8 = loader_mod.Loader(ds8, BATCH, seed=0)
    out: dict[str, Callable[[], dict[str, np.ndarray[Any, Any]]]] = {
        "npz": npz_next,
        "memory_shuffled": memory_next,
        "loader": shuffled.__next__,
        "loader_in_order": in_order.__next__,
        "loader_8_shards": shuffled8.__next__,
    }
    if with_grain:
        out.update(grain_methods(ds))
    return out


def grain_methods(ds: Any) -> dict[str, Callable[[], Any]]:
    import grain

    class Rows:
        """A grain random-access source: one row per index, from the memory maps."""

        def __len__(self) -> int:
            return int(ds.rows)

        def __getitem__(self, i: int) -> dict[str, np.ndarray[Any, Any]]:
            g = ds.gather(np.array([i]))
            return {k: v[0] for k, v in g.items()}

    rows_it = iter(grain.MapDataset.source(Rows()).shuffle(seed=0).repeat().batch(BATCH))
    index_it = iter(
        grain.MapDataset.range(ds.rows).shuffle(seed=0).repeat().batch(BATCH).map(ds.gather)
    )
    check_grain_resume(grain, ds)
    return {"grain_rows": rows_it.__next__, "grain_index": index_it.__next__}


def check_grain_resume(grain: Any, ds: Any) -> None:
    """grain's iterator state: JSON-able, exact resume across an epoch boundary."""
    n = ds.rows
    per_epoch = n // BATCH

    def pipeline() -> Any:
        return iter(
            grain.MapDataset.range(n)
            .shuffle(seed=3)
            .repeat()
            .batch(BATCH, drop_remainder=True)
            .to_iter_dataset()
        )

    ref = pipeline()
    want = [next(ref) for _ in range(per_epoch + 5)]
    it = pipeline()
    for _ in range(per_epoch - 2):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    again = pipeline()
    again.set_state(state)
    got = [next(again) for _ in range(7)]
    exact = all(np.array_equal(a, b) for a, b in zip(got, want[per_epoch - 2 :], strict=True))
    e0 = np.sort(np.concatenate(want[:per_epoch]))
    print(
        json.dumps(
            {
                "grain_state": state,
                "grain_exact_resume_across_epoch": exact,
                "grain_epoch0_rows_unique": bool(len(np.unique(e0)) == len(e0)),
            }
        )
    )


def measure(
    fns: dict[str, Callable[[], Any]], rounds: int, block_s: float
) -> dict[str, list[float]]:
    ks = {}
    for name, fn in fns.items():
        for _ in range(50):
            fn()
        t = time.perf_counter()
        n = 0
        while time.perf_counter() - t < 0.05:
            fn()
            n += 1
        per = (time.perf_counter() - t) / n
        ks[name] = max(1, int(block_s / per))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            fn, k = fns[name], ks[name]
            t = time.perf_counter()
            for _ in range(k):
                fn()
            samples[name].append((time.perf_counter() - t) / k * 1e6)
    return samples


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--block-s", type=float, default=0.1)
    p.add_argument("--grain", action="store_true", help="also time grain (needs grain)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fns = methods(args.rows, os.path.join(tmp, "ds"), args.grain)
        samples = measure(fns, args.rounds, args.block_s)
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["npz"]
    print(f"batch {BATCH} x {WIDTH} float32 (x and y), {args.rows} rows, {args.rounds} rounds")
    print(f"{'method':<18}{'median us/batch':>16}{'min':>10}{'vs npz':>10}{'vs memory':>11}")
    for k, v in med.items():
        print(
            f"{k:<18}{v:>16.1f}{min(samples[k]):>10.1f}{v / base:>9.1f}x"
            f"{v / med['memory_shuffled']:>10.2f}x"
        )
    print(
        json.dumps(
            {
                "median_us": {k: round(v, 2) for k, v in med.items()},
                "loader_minus_npz_us": round(med["loader"] - base, 2),
                "loader_over_memory_shuffled": round(med["loader"] / med["memory_shuffled"], 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
