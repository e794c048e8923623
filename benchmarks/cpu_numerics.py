"""What compiling the CPU programs with YNNPACK's fusions off costs in step time.

The runtime compiles its CPU programs with XLA's ``xla_cpu_experimental_ynn_fusion_type``
empty (``runtime/_compat.py``'s ``cpu_numerics_overrides``; docs/numerics.md), so that
newer jaxlibs do not hand reductions, convolutions and matmuls to YNNPACK. This script
measures, side by side in one process, the runtime's default against XLA's own default
(the same load with the override removed) on the benchmark's models, and prints the
ratio of median step times and how far apart the two runs' losses are.

Two stages, in two environments::

    .venv/bin/python benchmarks/cpu_numerics.py export build/cpu_numerics        # torch
    .venv-lean/bin/python benchmarks/cpu_numerics.py time build/cpu_numerics     # no torch

``export`` writes MODEL.stepbundle and MODEL.npz (stacked batches) for the MLP (depths 4
and 32), the small GPT (4 blocks), examples/cifar_cnn.py and, with ``--resnet``,
torchvision's resnet18 at 64x64 (benchmarks/resnet18_float64.py's recipe). ``time``
loads each bundle twice and alternates rounds of ``--steps`` steps between the two.

Imports: stepbundle.runtime (time), torch and the exporter (export).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def export_all(out: Path, resnet: bool) -> None:
    sys.path[:0] = [str(HERE), str(ROOT / "examples"), str(ROOT / "tests")]
    import cifar_cnn
    import models
    from support import make_batches as support_batches

    from stepbundle.exporter import export

    out.mkdir(parents=True, exist_ok=True)
    cases = [
        models.Case("mlp", 4),
        models.Case("mlp", 32),
        models.Case("gpt", 4, models.GPTConfig()),
    ]
    for case in cases:
        batches = models.make_batches(case, 4)
        export(models.recipe(case, batches[0]), out / f"{case.label}.stepbundle")
        np.savez(
            out / f"{case.label}.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]}
        )
    export(cifar_cnn.recipe(), out / "cifar_cnn.stepbundle")
    np.savez(out / "cifar_cnn.npz", **cifar_cnn.data(4))
    if resnet:
        import resnet18_float64

        batches = support_batches(resnet18_float64.recipe(), 4)
        export(resnet18_float64.recipe(), out / "resnet18.stepbundle")
        np.savez(out / "resnet18.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]})


def _load(path: Path, ynn_off: bool) -> Any:
    from stepbundle.runtime import _compat, load

    if ynn_off:
        return load(
            path, options=LoadOptions(compile=CompileOptions(cache_dir=False, entries="train"))
        )
    saved = _compat.cpu_numerics_overrides
    _compat.cpu_numerics_overrides = lambda flags: ((), "XLA's default (benchmark)")
    try:
        return load(
            path, options=LoadOptions(compile=CompileOptions(cache_dir=False, entries="train"))
        )
    finally:
        _compat.cpu_numerics_overrides = saved


def time_all(folder: Path, steps: int, rounds: int) -> None:
    from stepbundle.runtime.train.batches import iter_batches

    print(
        f"| model | runtime default (YNNPACK off), ms/step | XLA's default, ms/step | ratio | "
        f"losses apart (relative, {steps} steps) |"
    )
    print("|---|---|---|---|---|")
    for path in sorted(folder.glob("*.stepbundle")):
        with np.load(path.with_suffix(".npz"), allow_pickle=False) as z:
            batches = iter_batches({k: z[k] for k in z.files})
        trainers = {"off": _load(path, True), "xla": _load(path, False)}
        losses = {k: [float(m["loss"]) for m in t.run(batches, steps)] for k, t in trainers.items()}
        samples: dict[str, list[float]] = {"off": [], "xla": []}
        for _ in range(rounds):
            for k, t in trainers.items():
                t0 = time.perf_counter()
                t.run(batches, steps)
                t.block_until_ready()
                samples[k].append((time.perf_counter() - t0) / steps * 1000)
        med = {k: statistics.median(v) for k, v in samples.items()}
        a, b = np.array(losses["off"]), np.array(losses["xla"])
        apart = float(np.max(np.abs(a - b) / np.abs(b)))
        print(
            f"| {path.stem} | {med['off']:.3f} | {med['xla']:.3f} | "
            f"{med['off'] / med['xla']:.2f} | {apart:.2g} |",
            flush=True,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("out", type=Path)
    e.add_argument("--resnet", action="store_true")
    t = sub.add_parser("time")
    t.add_argument("folder", type=Path)
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.cmd == "export":
        export_all(args.out, args.resnet)
    else:
        time_all(args.folder, args.steps, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
