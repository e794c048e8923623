"""What the runtime's CPU numerics cost in step time, and what they buy in accuracy.

The runtime compiles its CPU programs with long float sums in blocks and YNNPACK's
fusions off (``runtime/compile/cpu_numerics.py``; docs/numerics.md). This script loads
each bundle three ways, side by side in one process:

- ``default``: the runtime's default;
- ``unblocked``: sums as the program writes them (``STEPBUNDLE_CPU_BLOCKED_SUMS=0``),
  YNNPACK off: the default before the blocks;
- ``xla``: XLA's own default (no blocks, no YNNPACK override: on jax >= 0.8 XLA:CPU may
  hand reductions, convolutions and matmuls to YNNPACK);

and, for ``accuracy``, ``xla+blocked`` too. ``time`` prints the median step time of each
and the ratios; ``accuracy`` trains the BatchNorm models 4 steps over 4 distinct batches
and compares every state tensor with PyTorch's float64 and float32 training of the same
recipe, made by ``export``.

Two stages, in two environments::

    .venv/bin/python benchmarks/cpu_numerics.py export build/cpu_numerics --resnet     # torch
    .venv-lean/bin/python benchmarks/cpu_numerics.py time build/cpu_numerics           # no torch
    .venv-lean/bin/python benchmarks/cpu_numerics.py accuracy build/cpu_numerics \\
        --out benchmarks/results/cpu_numerics.md

``export`` writes MODEL.stepbundle and MODEL.npz (stacked batches) for the MLP (depths 4
and 32), the small GPT (4 blocks), examples/cifar_cnn.py, the BatchNorm stem of
tests/golden/make_float64_stem.py (``bn_stem``), the same CNN with BatchNorm after each
convolution (``bn_cnn_b32``, 32 64x64 images) and, with ``--resnet``, torchvision's
resnet18 at 64x64 (benchmarks/resnet18_float64.py's recipe); for the last three also
MODEL.ref.npz, PyTorch's states after 4 steps in float64 and float32. ``--out`` appends the
table to a results file, under a heading naming the host, jax and the command.

Imports: stepbundle.runtime (time, accuracy), torch and the exporter (export).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STEPS = 4  # accuracy: steps over 4 distinct batches


def _bn_cnn_b32() -> Any:
    """make_float64.py's CNN (BatchNorm after each convolution) on 32 64x64 images."""
    import make_float64
    import torch

    from stepbundle.exporter import Recipe

    r = make_float64.recipe()
    g = torch.Generator().manual_seed(7)
    example = {"x": torch.randn(32, 3, 64, 64, generator=g), "y": torch.arange(32) % 10}
    return Recipe(model=r.model, optimizer=r.optimizer, step=r.step, example_batch=example)


def _references(recipe_fn: Any, batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    from support import train_eager_cpu

    init = train_eager_cpu(recipe_fn, batches, 0).state
    f64 = train_eager_cpu(recipe_fn, batches, STEPS, float64=True)
    f32 = train_eager_cpu(recipe_fn, batches, STEPS)
    out: dict[str, np.ndarray] = {}
    for name, value in f64.state.items():
        if np.issubdtype(value.dtype, np.floating) and not name.endswith(".grad"):
            out[f"float64:{name}"] = value
            out[f"float32:{name}"] = f32.state[name]
            if name in init:
                out[f"init:{name}"] = init[name]
    out["loss_float64"] = f64.series("loss")
    out["loss_float32"] = f32.series("loss")
    return out


def export_all(out: Path, resnet: bool) -> None:
    sys.path[:0] = [
        str(HERE),
        str(ROOT / "examples"),
        str(ROOT / "tests"),
        str(ROOT / "tests" / "golden"),
    ]
    import cifar_cnn
    import make_float64_stem
    import models
    from support import make_batches as support_batches

    from stepbundle.exporter import export

    out.mkdir(parents=True, exist_ok=True)

    def save(name: str, batches: list[dict[str, np.ndarray]]) -> None:
        np.savez(out / f"{name}.npz", **{k: np.stack([b[k] for b in batches]) for k in batches[0]})

    for case in (
        models.Case("mlp", 4),
        models.Case("mlp", 32),
        models.Case("gpt", 4, models.GPTConfig()),
    ):
        batches = models.make_batches(case, 4)
        export(models.recipe(case, batches[0]), out / f"{case.label}.stepbundle", check=False)
        save(case.label, batches)
    export(cifar_cnn.recipe(), out / "cifar_cnn.stepbundle", check=False)
    np.savez(out / "cifar_cnn.npz", **cifar_cnn.data(4))
    bn: list[tuple[str, Any, list[dict[str, np.ndarray]]]] = [
        ("bn_stem", make_float64_stem.recipe, make_float64_stem.batches()),
        ("bn_cnn_b32", _bn_cnn_b32, support_batches(_bn_cnn_b32(), 4)),
    ]
    if resnet:
        import resnet18_float64

        bn.append(
            ("resnet18", resnet18_float64.recipe, support_batches(resnet18_float64.recipe(), 4))
        )
    for name, recipe_fn, batches in bn:
        # Exported before any eager CPU training: an eager backward first leaves torch's
        # autograd without a queue for the XLA device.
        export(recipe_fn(), out / f"{name}.stepbundle", check=False)
        save(name, batches)
    for name, recipe_fn, batches in bn:
        np.savez(out / f"{name}.ref.npz", **_references(recipe_fn, batches))
        print(f"# {name}: references written", file=sys.stderr, flush=True)


CONFIGS = ("default", "unblocked", "xla")


@contextlib.contextmanager
def _numerics(config: str) -> Iterator[None]:
    """The runtime's CPU numerics as ``config`` names them, for the loads inside."""
    from stepbundle.runtime import _compat
    from stepbundle.runtime.compile.cpu_numerics import BLOCKED_SUMS_ENV

    saved_env = os.environ.get(BLOCKED_SUMS_ENV)
    saved = _compat.cpu_numerics_overrides
    os.environ[BLOCKED_SUMS_ENV] = "1" if config in ("default", "xla+blocked") else "0"
    if config.startswith("xla"):
        _compat.cpu_numerics_overrides = lambda flags: ((), "XLA's default (benchmark)")
    try:
        yield
    finally:
        _compat.cpu_numerics_overrides = saved
        if saved_env is None:
            os.environ.pop(BLOCKED_SUMS_ENV, None)
        else:
            os.environ[BLOCKED_SUMS_ENV] = saved_env


def _load(path: Path, config: str) -> Any:
    from stepbundle.runtime import load

    with _numerics(config):
        return load(
            path, options=LoadOptions(compile=CompileOptions(cache_dir=False, entries="train"))
        )


def _batches(path: Path) -> list[dict[str, np.ndarray]]:
    from stepbundle.runtime.train.batches import iter_batches

    with np.load(path.with_suffix(".npz"), allow_pickle=False) as z:
        return iter_batches({k: z[k] for k in z.files})


def _heading(command: str) -> str:
    import jax

    return (
        f"### `{command}`\n\n"
        f"Host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"({_cpu_model()}); jax {jax.__version__}.\n"
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                simd = (
                    "AVX-512"
                    if " avx512f" in flags
                    else ("AVX2" if " avx2" in flags else "no AVX2")
                )
                return f"{line.split(':', 1)[1].strip()}, {simd}"
    return "unknown CPU"


def time_all(folder: Path, steps: int, rounds: int) -> list[str]:
    lines = [
        "| model | default, ms/step | unblocked (YNNPACK off) | XLA's default "
        "| default / unblocked | default / XLA's |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for path in sorted(folder.glob("*.stepbundle")):
        batches = _batches(path)
        trainers = {c: _load(path, c) for c in CONFIGS}
        for t in trainers.values():  # warm: the first steps allocate
            t.run(batches, 2)
            t.block_until_ready()
        t0 = time.perf_counter()
        trainers["default"].run(batches, 1)
        trainers["default"].block_until_ready()
        n = max(2, min(steps, int(2.0 / max(time.perf_counter() - t0, 1e-6))))
        # Process CPU time (every thread of this process), beside wall time: on a shared
        # host other processes' load moves wall time far more than it moves CPU time.
        wall: dict[str, list[float]] = {c: [] for c in CONFIGS}
        cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for _ in range(rounds):
            for c, t in trainers.items():
                t0, c0 = time.perf_counter(), time.process_time()
                t.run(batches, n)
                t.block_until_ready()
                wall[c].append((time.perf_counter() - t0) / n * 1000)
                cpu[c].append((time.process_time() - c0) / n * 1000)
        w = {c: statistics.median(v) for c, v in wall.items()}
        u = {c: statistics.median(v) for c, v in cpu.items()}
        cell = {c: f"{u[c]:.3f} CPU ({w[c]:.3f} wall)" for c in CONFIGS}
        line = (
            f"| {path.stem} | {cell['default']} | {cell['unblocked']} | {cell['xla']} | "
            f"{u['default'] / u['unblocked']:.2f} ({w['default'] / w['unblocked']:.2f}) | "
            f"{u['default'] / u['xla']:.2f} ({w['default'] / w['xla']:.2f}) |"
        )
        print(line, flush=True)
        lines.append(line)
    lines.append("")
    lines.append(
        f"Medians of {rounds} rounds of up to {steps} steps (fewer where a step takes over "
        "0.1 s), the three loads' rounds alternating; ratios of CPU time, wall time in "
        "brackets."
    )
    return lines


FLOOR = 2.0**-20
"""Tensors PyTorch float32 keeps within this of float64 (relative to how far they moved)
are left out of the ratio: at a few float32 ulps a ratio says nothing."""


def accuracy_all(folder: Path) -> list[str]:
    lines = [
        f"State after {STEPS} steps over {STEPS} distinct batches, every floating tensor's "
        "normwise distance from PyTorch float64 relative to how far float64 moved it "
        "(an optimizer's momentum: to its size). `worst` is the largest distance; `ratio` "
        f"the largest distance over PyTorch float32's for the same tensor (tensors float32 "
        f"keeps within {FLOOR:.1e} left out), with the tensor.",
        "",
        "| model | PyTorch float32 worst | loss, PyTorch float32 | config | worst | ratio to PyTorch float32 | "
        "loss (relative, worst step) |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for path in sorted(folder.glob("*.ref.npz")):
        name = path.name.removesuffix(".ref.npz")
        bundle = folder / f"{name}.stepbundle"
        batches = _batches(bundle)
        with np.load(path, allow_pickle=False) as z:
            ref = {k: z[k] for k in z.files}
        f64_loss, f32_loss = ref["loss_float64"], ref["loss_float32"]
        for config in (*CONFIGS, "xla+blocked"):
            t = _load(bundle, config)
            losses = np.array([float(m["loss"]) for m in t.run(batches, STEPS)])
            state = t.state_dict()
            dist: dict[str, tuple[float, float]] = {}
            for key in ref:
                if not key.startswith("float64:"):
                    continue
                tensor = key.removeprefix("float64:")
                f64 = ref[key]
                init = ref.get(f"init:{tensor}")
                moved = float(np.linalg.norm(f64 - init if init is not None else f64))
                if moved == 0.0:
                    continue
                got = float(np.linalg.norm(state[tensor].astype(np.float64) - f64)) / moved
                dist[tensor] = (got, float(np.linalg.norm(ref[f"float32:{tensor}"] - f64)) / moved)
            worst = max(d[0] for d in dist.values())
            f32_worst = max(d[1] for d in dist.values())
            ratios = {k: g / f for k, (g, f) in dist.items() if f > FLOOR}
            r_name = max(ratios, key=ratios.__getitem__)
            loss = float(np.max(np.abs(losses - f64_loss) / np.abs(f64_loss)))
            f32_l = float(np.max(np.abs(f32_loss - f64_loss) / np.abs(f64_loss)))
            line = (
                f"| {name} | {f32_worst:.3g} | {f32_l:.2g} | {config} | {worst:.3g} | "
                f"{ratios[r_name]:.2f} (`{r_name}`) | {loss:.2g} |"
            )
            print(line, flush=True)
            lines.append(line)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("out", type=Path)
    e.add_argument("--resnet", action="store_true")
    for name in ("time", "accuracy"):
        s = sub.add_parser(name)
        s.add_argument("folder", type=Path)
        s.add_argument("--out", type=Path, help="append the table to this results file")
        if name == "time":
            s.add_argument("--steps", type=int, default=20)
            s.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.cmd == "export":
        export_all(args.out, args.resnet)
        return 0
    if args.cmd == "time":
        lines = time_all(args.folder, args.steps, args.rounds)
    else:
        lines = accuracy_all(args.folder)
    if args.out is not None:
        command = "benchmarks/cpu_numerics.py " + " ".join(sys.argv[1:])
        with args.out.open("a") as f:
            f.write(_heading(command) + "\n" + "\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
