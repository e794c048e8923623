"""Where ``trainer.step`` spends its time, for one bundle, in a process without torch.

    .venv/bin/python benchmarks/profile_step.py BUNDLE [--seconds 20]            # cProfile
    .venv/bin/python benchmarks/profile_step.py BUNDLE --py-spy [--seconds 20]   # native frames
    .venv/bin/python benchmarks/profile_step.py BUNDLE --breakdown              # each piece alone

cProfile sees Python functions only: the C++ inside ``LoadedExecutable.execute`` is one
line. ``--py-spy`` (``pip install py-spy``) samples native frames too, so it shows what
inside jaxlib the time goes to (argument handling, building output arrays, freeing the
donated ones, the garbage collector). The report is the share of the samples taken inside
``Trainer.step`` that fall in each frame (inclusive), largest first.

The batch is synthesized from the bundle's batch signature (normal floats, zero integers).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stepbundle.runtime import CompileOptions, LoadOptions


def _batch(path: str) -> dict[str, Any]:
    import numpy as np

    import stepbundle.schema as codec
    from stepbundle.runtime.dtypes import to_numpy

    program = codec.read_manifest(path).entries["train"].programs[0]
    rng = np.random.default_rng(0)
    out = {}
    for b in program.batch:
        dt = to_numpy(b.spec.dtype)
        shape = tuple(b.spec.shape)
        if np.issubdtype(dt, np.floating):
            out[b.name] = rng.standard_normal(shape).astype(dt)
        else:
            out[b.name] = np.zeros(shape, dtype=dt)
    return out


def _loop(trainer: Any, batch: dict[str, Any], seconds: float) -> int:
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            m = trainer.step(batch)
        float(m["loss"])
        n += 20
    return n


def worker(path: str, seconds: float) -> None:
    from stepbundle.runtime import load

    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    batch = _batch(path)
    _loop(trainer, batch, 1.0)
    n = _loop(trainer, batch, seconds)
    print(f"{n} steps in {seconds:.0f} s: {1e3 * seconds / n:.3f} ms per step", flush=True)


def cprofile(path: str, seconds: float) -> None:
    import cProfile
    import pstats

    from stepbundle.runtime import load

    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    batch = _batch(path)
    _loop(trainer, batch, 1.0)
    prof = cProfile.Profile()
    prof.enable()
    n = _loop(trainer, batch, seconds)
    prof.disable()
    print(f"{n} steps profiled")
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def breakdown(path: str, reps: int = 2000) -> None:
    """Microseconds per call of each piece of ``Trainer.step``, timed alone."""
    import statistics

    from stepbundle.runtime import load

    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    batch = _batch(path)
    _loop(trainer, batch, 1.0)
    plan = trainer._router.plans["train"][0]
    _, dev = trainer._dispatcher.pick("train", batch)

    def us(fn: Any, n: int = reps) -> float:
        fn()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(runs)

    state = list(trainer._store.buffers)
    outs = list(range(max(o for o, _ in plan.update_slots) + 1))

    def update() -> None:
        for pos, si in plan.update_slots:
            state[si] = outs[pos]

    def metrics() -> None:
        {name: outs[pos] for pos, name in plan.metric_slots}  # noqa: B018

    def step_wait() -> None:
        float(trainer.step(batch)["loss"])

    rows = [
        (
            "_pick, host (numpy) batch: checks + transfer",
            us(lambda: trainer._dispatcher.pick("train", batch)),
        ),
        ("_pick, batch already on the device", us(lambda: trainer._dispatcher.pick("train", dev))),
        (
            f"_args ({len(plan.state_slots)} state slots)",
            us(lambda: trainer._dispatcher.args(plan, dev, trainer.seed)),
        ),
        (f"state update loop ({len(plan.update_slots)} outputs)", us(update)),
        ("metrics dict", us(metrics)),
        ("whole step, waiting for its loss", us(step_wait, 50)),
    ]
    print(
        f"{path}: {len(plan.compiled.program.inputs)} inputs, {len(plan.compiled.program.outputs)} outputs"
    )
    for name, v in rows:
        print(f"{v:10.1f} us  {name}")


def _clean(frame: str) -> str:
    for _ in range(3):
        frame = re.sub(r"<[^<>]*>", "", frame)
    return frame[:140]


def aggregate(raw: Path, marker: str = "Trainer.step (", top: int = 40) -> list[tuple[float, str]]:
    """Inclusive share of the samples under ``marker`` for each frame below it."""
    inside = 0
    incl: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        first = next((i for i, f in enumerate(frames) if marker in f), None)
        if first is None:
            continue
        n = int(count)
        inside += n
        for f in {_clean(f) for f in frames[first:]}:
            incl[f] += n
    return [(v / inside, k) for k, v in incl.most_common(top)] if inside else []


def pyspy(path: str, seconds: float) -> None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(exe):
        raise SystemExit("py-spy is not installed: pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        cmd = [
            exe,
            "record",
            "--native",
            "-r",
            "100",
            "-f",
            "raw",
            "-o",
            str(raw),
            "--",
        ]
        cmd += [sys.executable, __file__, path, "--worker", "--seconds", str(seconds)]
        subprocess.run(cmd, check=True)
        rows = aggregate(raw)
    print("share of Trainer.step samples, inclusive:")
    for share, frame in rows:
        if share >= 0.02:
            print(f"{100 * share:5.1f}%  {frame}")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("bundle")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--py-spy", action="store_true", help="sample native frames with py-spy")
    ap.add_argument(
        "--breakdown", action="store_true", help="time each piece of Trainer.step on its own"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.bundle, args.seconds)
    elif args.breakdown:
        breakdown(args.bundle)
    elif args.py_spy:
        pyspy(args.bundle, args.seconds)
    else:
        cprofile(args.bundle, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
