"""Time per batch of the on-disk loader vs the in-memory ``.npz`` path (and, optionally, grain).

The batch is MLP depth 32's (``benchmarks/models.py``): ``x`` and ``y``, 32 x 16
float32. A dataset of ``--rows`` rows is written to a temporary folder in the on-disk
layout (``runtime/data/dataset.py``) and read back warm (in the page cache, as after the first
epoch). Methods, each producing one batch per call:

- ``npz``: the current ``--data x.npz`` path: the file's stacked batches split once by
  ``runtime.batches.iter_batches``, then ``batches[i % S]`` (no shuffling at all).
- ``memory_shuffled``: the same rows as in-memory arrays, one fancy index per input by
  a slice of a fresh per-epoch permutation (what shuffling in memory costs).
- ``loader``: ``runtime.loader.Loader`` over the on-disk dataset, shuffled.
- ``loader_in_order``: the same with ``shuffle=False`` (contiguous slices).
- ``loader_8_shards``: shuffled, the rows split over 8 shards (the default shard size
  puts them in one), so a batch touches ~8 shards: one ``take`` per input per shard.
- ``loader_pread``, ``loader_pread_in_order``: ``loader`` and ``loader_in_order`` over
  the folder opened while its files were open for writing, so that no read lease was
  granted and the shards are read with ``pread`` (``runtime/data/shard_file.py``: what
  another user's files, NFS or macOS get).
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

**Trainer mode** (``--trainer``): the issue's figure itself, the whole step. The MLP
depth-32 bundle is exported the way ``benchmarks/run.py`` does it (``run.export_case``
on ``models.make_batches``), in a subprocess under the export environment
(``--export-python``, default ``.venv/bin/python``; ``--export-to DIR`` is that
subprocess's entry). The same ``--batches`` batches are then, in this one process:

- ``npz``: a list of batches, as ``--data x.npz`` reads them (``iter_batches`` of the
  stacked arrays), stepped by ``trainer.run(batches, n)``;
- ``loader``: written as a dataset folder (``write_dataset``), opened, and stepped by
  ``trainer.run(Loader(dataset, 32, seed=0), n)`` (shuffled, running on across epochs).

Both keep no metrics (``keep_metrics=False``); a block is timed from the call until its
last loss is read, wall (``perf_counter``) and CPU (``process_time``, all threads of
the process). After a warm-up of both, ``--rounds`` interleaved rounds (the order
alternates) of ``--steps`` steps each; the figures are medians per step, and the ratio
``loader / npz`` is the issue's budget (<= 1.10). The stepping runs under the Python
that runs this script; the results file was made with the lean environment
(``.venv-lean/bin/python``, no torch), which is what a training job runs::

    .venv-lean/bin/python benchmarks/data_pipeline.py --trainer
    .venv-lean/bin/python benchmarks/data_pipeline.py --trainer --quick   # seconds

``--rows-per-shard N`` splits the folder into shards (default: the default shard size,
one shard here); with many small shards each batch touches many of them, which is where
``Dataset.gather`` spends its time (``results/data_pipeline.md``).

Imports: numpy, stepbundle.runtime's data modules (and grain with ``--grain``; the
runtime's ``load`` with ``--trainer``; torch and the benchmark's ``run``/``models`` with
``--export-to``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions

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
        from stepbundle.runtime.data import dataset, dataset_writer, loader

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
        sys.modules["stepbundle.runtime.data.dataset"],
        sys.modules["stepbundle.runtime.data.dataset_writer"],
        sys.modules["stepbundle.runtime.data.loader"],
    )


def _iter_batches(data: dict[str, np.ndarray[Any, Any]]) -> list[dict[str, np.ndarray[Any, Any]]]:
    try:
        from stepbundle.runtime.train.batches import iter_batches

        return iter_batches(data)
    except ImportError:  # no jax: the same split, written out (runtime/train/batches.py)
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

    # A copy opened while its shard files are open for writing: no lease is granted, so
    # every shard is read with pread (runtime/data/shard_file.py). (Opening the first
    # folder's files for writing would break this process's leases on them.)
    writer_mod.write_dataset(folder + "p", {"x": x, "y": y})
    writing = [open(f, "r+b") for f in sorted(Path(folder + "p").glob("*.npy"))]  # noqa: SIM115
    ds_pread = dataset_mod.open_dataset(folder + "p")
    for f in writing:
        f.close()
    for _ in dataset_mod.iter_rows(ds_pread):  # warm the page cache
        pass
    shuffled = loader_mod.Loader(ds, BATCH, seed=0)
    in_order = loader_mod.Loader(ds, BATCH, shuffle=False)
    shuffled8 = loader_mod.Loader(ds8, BATCH, seed=0)
    out: dict[str, Callable[[], dict[str, np.ndarray[Any, Any]]]] = {
        "npz": npz_next,
        "memory_shuffled": memory_next,
        "loader": shuffled.__next__,
        "loader_in_order": in_order.__next__,
        "loader_8_shards": shuffled8.__next__,
        "loader_pread": loader_mod.Loader(ds_pread, BATCH, seed=0).__next__,
        "loader_pread_in_order": loader_mod.Loader(ds_pread, BATCH, shuffle=False).__next__,
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


def export_mlp(depth: int, n_batches: int, out: Path) -> dict[str, Any]:
    """Export MLP ``depth`` as ``run.py`` does and save its ``n_batches`` batches (torch env).

    Writes ``out/mlp<depth>.stepbundle`` and ``out/batches.npz`` (``x`` and ``y`` stacked,
    ``(n_batches, 32, 16)``: the ``--data`` layout). Returns ``run.export_case``'s record.
    """
    here = str(ROOT / "benchmarks")
    if here not in sys.path:
        sys.path.insert(0, here)
    import models
    from run import export_case

    case = models.Case("mlp", depth)
    batches = models.make_batches(case, n_batches)
    out.mkdir(parents=True, exist_ok=True)
    record = export_case(case, batches[0], out / f"mlp{depth}.stepbundle")
    np.savez(out / "batches.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    return record


def _ensure_bundle(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The bundle and the batches file: ``--bundle-dir``'s, or exported now into ``work``."""
    folder = Path(args.bundle_dir) if args.bundle_dir else work / "export"
    bundle, data = folder / f"mlp{args.depth}.stepbundle", folder / "batches.npz"
    if bundle.is_file() and data.is_file():
        return bundle, data
    cmd = [
        args.export_python,
        str(Path(__file__).resolve()),
        "--export-to",
        str(folder),
        "--depth",
        str(args.depth),
        "--batches",
        str(args.batches),
    ]
    t0 = time.perf_counter()
    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(
            f"Exporting the MLP depth-{args.depth} bundle failed ({' '.join(cmd)}):\n"
            f"{proc.stderr[-3000:]}\nCheck that --export-python names a Python with torch "
            "and torch_xla (the project's .venv)."
        )
    print(f"exported {bundle.name} in {time.perf_counter() - t0:.1f} s ({args.export_python})")
    return bundle, data


def _block(trainer: Any, source: Any, steps: int) -> tuple[float, float]:
    """Wall and CPU seconds of ``trainer.run(source, steps)`` until its last loss is read."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = trainer.run(source, steps, keep_metrics=False)
    float(out[-1]["loss"])
    return time.perf_counter() - w0, time.process_time() - c0


def trainer_mode(args: argparse.Namespace) -> dict[str, Any]:
    """Time the trainer stepping over the in-memory batches vs a ``Loader`` (see the module)."""
    from stepbundle.runtime import load
    from stepbundle.runtime.data.dataset import open_dataset
    from stepbundle.runtime.data.dataset_writer import write_dataset
    from stepbundle.runtime.data.loader import Loader
    from stepbundle.runtime.train.batches import iter_batches

    with tempfile.TemporaryDirectory() as tmp:
        bundle, data_path = _ensure_bundle(args, Path(tmp))
        with np.load(data_path, allow_pickle=False) as z:
            stacked = {k: z[k] for k in z.files}
        batches = iter_batches(stacked)  # the --data x.npz path
        rows = {k: v.reshape(-1, *v.shape[2:]) for k, v in stacked.items()}
        write_dataset(os.path.join(tmp, "ds"), rows, rows_per_shard=args.rows_per_shard)
        ds = open_dataset(os.path.join(tmp, "ds"))
        loader = Loader(ds, BATCH, seed=0)
        trainer = load(bundle, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
        sources = {"npz": batches, "loader": loader}
        for src in sources.values():  # warm-up: compile, page cache, first epoch
            for _ in range(args.warmup_blocks):
                _block(trainer, src, args.steps)
        wall: dict[str, list[float]] = {k: [] for k in sources}
        cpu: dict[str, list[float]] = {k: [] for k in sources}
        names = list(sources)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                w, c = _block(trainer, sources[name], args.steps)
                wall[name].append(w / args.steps * 1e6)
                cpu[name].append(c / args.steps * 1e6)
        # Where the loader's time goes, outside the trainer (same process, warm).
        probe = Loader(ds, BATCH, seed=1)
        for _ in range(50):
            next(probe)
        k = max(200, args.steps)
        t0 = time.perf_counter()
        for _ in range(k):
            next(probe)
        next_us = (time.perf_counter() - t0) / k * 1e6
        t0 = time.perf_counter()
        for _ in range(k):
            probe.state()
        state_us = (time.perf_counter() - t0) / k * 1e6
        step_count = trainer.step_count
        rows_n, shards = ds.rows, len(ds.shard_rows)
        del trainer, loader, probe, ds
    med_w = {k: statistics.median(v) for k, v in wall.items()}
    med_c = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "python": sys.executable,
        "depth": args.depth,
        "batch": [BATCH, WIDTH],
        "dataset_rows": rows_n,
        "dataset_shards": shards,
        "in_memory_batches": len(batches),
        "steps_per_block": args.steps,
        "rounds": args.rounds,
        "step_count": step_count,
        "median_wall_us": {k: round(v, 1) for k, v in med_w.items()},
        "median_cpu_us": {k: round(v, 1) for k, v in med_c.items()},
        "ratio_wall": round(med_w["loader"] / med_w["npz"], 4),
        "ratio_cpu": round(med_c["loader"] / med_c["npz"], 4),
        "wall_samples_us": {k: [round(x, 1) for x in v] for k, v in wall.items()},
        "cpu_samples_us": {k: [round(x, 1) for x in v] for k, v in cpu.items()},
        "loader_next_us": round(next_us, 2),
        "loader_state_us": round(state_us, 2),
    }


def print_trainer(r: dict[str, Any]) -> None:
    w, c = r["median_wall_us"], r["median_cpu_us"]
    print(
        f"MLP depth {r['depth']}, batch {BATCH} x {WIDTH}, {r['dataset_rows']} rows in "
        f"{r['dataset_shards']} shard(s), {r['rounds']} interleaved rounds of "
        f"{r['steps_per_block']} steps, stepping under {r['python']}"
    )
    print(f"{'source':<10}{'wall us/step':>14}{'cpu us/step':>14}")
    for k in ("npz", "loader"):
        print(f"{k:<10}{w[k]:>14.1f}{c[k]:>14.1f}")
    print(
        f"loader / npz: wall {r['ratio_wall']:.3f}x, cpu {r['ratio_cpu']:.3f}x "
        f"(budget 1.10x); Loader.__next__ alone {r['loader_next_us']:.1f} us, "
        f"Loader.state() {r['loader_state_us']:.1f} us"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--block-s", type=float, default=0.1)
    p.add_argument("--grain", action="store_true", help="also time grain (needs grain)")
    p.add_argument("--trainer", action="store_true", help="time whole steps (see the module)")
    p.add_argument("--depth", type=int, default=32, help="trainer mode: MLP depth")
    p.add_argument("--batches", type=int, default=512, help="trainer mode: batches (rows/32)")
    p.add_argument("--steps", type=int, default=400, help="trainer mode: steps per block")
    p.add_argument("--warmup-blocks", type=int, default=2, help="trainer mode: per source")
    p.add_argument(
        "--rows-per-shard", type=int, help="trainer mode: shard size (default: the default)"
    )
    p.add_argument("--bundle-dir", help="trainer mode: reuse (or fill) this export folder")
    p.add_argument(
        "--export-python",
        default=str(ROOT / ".venv" / "bin" / "python"),
        help="trainer mode: the Python with torch and torch_xla that exports the bundle",
    )
    p.add_argument("--export-to", help="export the bundle and batches here, then exit")
    p.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    p.add_argument("--json", action="store_true", help="trainer mode: print the JSON too")
    args = p.parse_args()
    if args.export_to:
        print(json.dumps(export_mlp(args.depth, args.batches, Path(args.export_to))))
        return 0
    if args.trainer:
        if args.quick:
            args.depth, args.batches, args.steps = min(args.depth, 4), 8, 20
            args.rounds, args.warmup_blocks = 3, 1
        r = trainer_mode(args)
        print_trainer(r)
        if args.json:
            print(json.dumps(r))
        return 0
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
