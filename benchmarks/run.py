"""stepbundle's benchmark: the retrace gap, side by side, in one run.

    .venv/bin/python benchmarks/run.py [--quick] [--out build/bench]

For each case (an MLP of Linear(16, 16), LayerNorm(16), GELU blocks at several depths, and
a small GPT: benchmarks/models.py) it exports a bundle,
then times, interleaved and repeated in this one process: torch_xla re-tracing every
step, PyTorch eager, torch.compile, a hand-written jax.jit step, the stepbundle trainer,
and the floor (a bare execute loop of the trainer's own executable). Then, in fresh
processes: load-to-first-step time (cold and with a warm compile cache), bundle read
throughput for a state of about 500 MB, and peak RSS with and without donation.

Writes OUT/results.json, OUT/results.md and OUT/step_time.png, and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stepbundle.runtime import CompileOptions, LoadOptions, StateOptions

os.environ.setdefault("PJRT_DEVICE", "CPU")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

FULL = {
    "mode": "full",
    "depths": [4, 16, 32, 64],
    "gpt": {"vocab": 128, "block": 32, "layers": 4, "width": 64, "heads": 4, "batch": 8},
    "rounds": 21,
    "target_s": 0.15,
    "warmup_s": 1.0,
    "load_cases": "all",
    "warm_loads": 5,
    "first_step_torch_xla": True,
    "wide": {"width": 2048, "state_mb": 500},
    "rss_steps": 5,
    "read_repeats": 3,
    "diagnostic_depths": [32, 64],
    "diagnostic_rounds": 15,
    "diagnose_wide": True,
    "wide_rounds": 7,
    "profile_steps": 300,
}
QUICK = {
    "mode": "quick",
    "depths": [4, 8],
    "gpt": {"vocab": 64, "block": 16, "layers": 1, "width": 32, "heads": 2, "batch": 4},
    "rounds": 4,
    "target_s": 0.02,
    "warmup_s": 0.1,
    "load_cases": "first",
    "warm_loads": 1,
    "first_step_torch_xla": False,  # two torch_xla processes: ~20 s
    "wide": {"width": 1024, "state_mb": 40},
    "rss_steps": 3,
    "read_repeats": 1,
    "diagnostic_depths": [4],
    "diagnostic_rounds": 3,
    "diagnose_wide": False,
    "wide_rounds": 0,
    "profile_steps": 30,
}


STEPS_PER_CALL = (8, 32)
"""The K of the ``stepbundle_k<K>`` methods (``CompileOptions(steps_per_call=K)``); K = 1 is
``stepbundle``."""


def git_state() -> dict[str, Any]:
    """The commit the figures were measured at, and whether the tree had changes."""

    def git(*a: str) -> str:
        return subprocess.run(
            ["git", *a], capture_output=True, text=True, timeout=30, cwd=ROOT, check=True
        ).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> dict[str, Any]:
    import jax
    import torch
    import torch_xla

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    lscpu: dict[str, str] = {}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU family", "Model", "Hypervisor vendor"):
                lscpu[key.strip()] = value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    cpu = lscpu.get("Model name", cpu)
    return {
        "cpu": cpu,
        "lscpu": lscpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "torch_xla": str(torch_xla.__version__),
        "jax": str(jax.__version__),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def child(*args: str, timeout: float = 600, script: str = "child.py") -> dict[str, Any]:
    """Run ``script`` in a fresh process; its JSON result, plus ``process_wall_s``: the
    wall time of the whole process, interpreter start-up and exit included."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(HERE / script), *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    return out


def export_case(case: Any, batch: dict[str, Any], path: Path) -> dict[str, Any]:
    import models

    from stepbundle.exporter import export

    t0 = time.perf_counter()
    rep = export(models.recipe(case, batch), path)
    wall = time.perf_counter() - t0
    program = rep.manifest.entries["train"].programs[0]
    return {
        "case": case.name,
        "depth": case.depth,
        "export_s": wall,
        "stages_s": rep.stage_seconds,
        "bundle_bytes": rep.size,
        "graph_inputs": len(program.inputs),
        "graph_outputs": len(program.outputs),
        "input_counts": rep.input_counts,
    }


def time_case(case: Any, bundle: Path, cfg: dict[str, Any], cache: Path) -> list[dict[str, Any]]:
    import methods as mt
    import models
    from timing import measure

    from stepbundle.runtime import load

    batches = models.make_batches(case, 4)
    trainer = load(bundle, options=LoadOptions(compile=CompileOptions(cache_dir=cache)))
    multi = [
        load(bundle, options=LoadOptions(compile=CompileOptions(cache_dir=cache, steps_per_call=k)))
        for k in STEPS_PER_CALL
    ]
    ms: list[mt.Method] = [
        mt.TorchXlaLazy(case, batches),
        mt.TorchXlaDynamo(case, batches, whole_step=False),
        mt.TorchXlaDynamo(case, batches, whole_step=True),
        mt.TorchEager(case, batches),
        mt.TorchCompile(case, batches),
        mt.JaxJit(case, batches),
        mt.Stepbundle(trainer, batches),
        *(mt.StepbundleK(t, batches, k) for t, k in zip(multi, STEPS_PER_CALL)),
        mt.StepbundleDeviceBatch(trainer, batches),
        mt.Floor(trainer, batches),
    ]
    extra: dict[str, dict[str, float]] = {}
    for m in ms:
        t0 = time.perf_counter()
        m.setup()
        extra[m.name] = {"setup_s": time.perf_counter() - t0}
    timings = measure(ms, rounds=cfg["rounds"], target_s=cfg["target_s"], warmup_s=cfg["warmup_s"])
    for m in ms:
        m.close()
    floor = timings["floor"].median_ms
    lazy = timings["torch_xla_lazy"].median_ms
    return [
        {
            **_record(case.name, case.depth, name, t, floor),
            "rounds": len(t.samples_ms),
            "ratio_to_torch_xla_lazy": t.median_ms / lazy,
            "setup_s": extra[name]["setup_s"],
            "samples_ms": [round(x, 5) for x in t.samples_ms],
        }
        for name, t in timings.items()
    ]


def _record(case: str, depth: int, method: str, t: Any, floor: float) -> dict[str, Any]:
    """The figures every timing record carries: medians, quartiles, ratio to floor."""
    return {
        "case": case,
        "depth": depth,
        "method": method,
        "median_ms": t.median_ms,
        "p25_ms": t.quantile_ms(0.25),
        "p75_ms": t.quantile_ms(0.75),
        "min_ms": t.min_ms,
        "cpu_median_ms": t.cpu_median_ms,
        "steps_per_block": t.steps_per_block,
        "ratio_to_floor": t.median_ms / floor,
    }


def diagnose(
    case: str,
    depth: int,
    bundle: Path,
    batches: list[dict[str, Any]],
    cfg: dict[str, Any],
    cache: Path,
    *,
    only: tuple[str, ...] = (),
    rounds: int | None = None,
) -> dict[str, Any]:
    """Where the time goes beyond the floor: dispatch paths, GC, packing (experiments.py).

    These experiments take the bundle's program apart, so they run on a trainer that
    holds every state tensor in its own buffer (``pack_state=False``): what the runtime
    did before it packed state, and what the packing experiments start from.
    """
    import experiments
    from timing import measure

    from stepbundle.runtime import load

    trainer = load(
        bundle,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=cache), state=StateOptions(pack_state=False)
        ),
    )
    ms, facts = experiments.make(trainer, bundle, batches)
    if only:
        ms = [m for m in ms if m.name in only]
    timings = measure(
        ms,
        rounds=rounds or cfg["diagnostic_rounds"],
        target_s=cfg["target_s"],
        warmup_s=cfg["warmup_s"],
    )
    floor = timings["floor"].median_ms
    records = [_record(case, depth, name, t, floor) for name, t in timings.items()]
    profile = experiments.profile_steps(trainer, batches, cfg["profile_steps"]) if not only else []
    return {"case": case, "depth": depth, "facts": facts, "records": records, "profile": profile}


def load_times(
    case: Any,
    bundle: Path,
    batch_npz: Path,
    cache_root: Path,
    torch_xla: bool,
    warm_loads: int = 1,
) -> dict[str, Any]:
    """Fresh processes, each to its first step's loss: the bundle cold (empty compile
    cache) and warm (the cache the cold one filled), cold without state packing, and
    torch_xla's own first step (trace + compile), cold and with its persistent cache warm.

    The warm load runs ``warm_loads`` times, one fresh process after another (each
    sample costs about a second, where a cold one costs a compile): ``warm`` is the
    sample with the median load-to-first-step time, and ``warm_samples_s`` lists them
    all, so one sample taken while another job held the machine's cores decides nothing.
    """

    def fresh(name: str) -> str:
        path = cache_root / f"{case.label}-{name}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return str(path)

    cache, unpacked, xla = fresh("packed"), fresh("unpacked"), fresh("torch_xla")
    cold = child("load", str(bundle), str(batch_npz), cache)
    samples = [child("load", str(bundle), str(batch_npz), cache) for _ in range(warm_loads)]
    samples.sort(key=lambda r: float(r["load_to_first_step_s"]))
    warm = dict(samples[len(samples) // 2])
    warm["warm_samples_s"] = [round(float(r["load_to_first_step_s"]), 4) for r in samples]
    cold_unpacked = child("load", str(bundle), str(batch_npz), unpacked, "--no-pack")
    out = {
        "case": case.name,
        "depth": case.depth,
        "cold": cold,
        "warm": warm,
        "cold_unpacked": cold_unpacked,
    }
    if torch_xla:
        spec = json.dumps(
            {"name": case.name, "depth": case.depth, "gpt": asdict(case.gpt) if case.gpt else None}
        )
        xla_cold = child(spec, str(batch_npz), xla, script="xla_first_step.py")
        xla_warm = child(spec, str(batch_npz), xla, script="xla_first_step.py")
        out["torch_xla_cold"], out["torch_xla_warm"] = xla_cold, xla_warm
    return out


def wide_bundle(cfg: dict[str, Any], work: Path) -> tuple[Path, Path, dict[str, Any]]:
    """Export a wide MLP whose state (parameters, gradients, AdamW moments) is ~state_mb."""
    import models
    import numpy as np
    import torch

    from stepbundle.exporter import Recipe, export

    width = cfg["width"]
    # Per Linear(width, width): weight + bias, times 4 (parameter, gradient, exp_avg, exp_avg_sq).
    per_layer = 4 * 4 * (width * width + width)
    depth = max(1, round(cfg["state_mb"] * 1e6 / per_layer))
    torch.manual_seed(0)
    model = models.wide_mlp(width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True, foreach=False)
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.standard_normal((models.MLP_BATCH, width)).astype(np.float32),
        "y": rng.standard_normal((models.MLP_BATCH, width)).astype(np.float32),
    }
    example = {k: torch.from_numpy(v) for k, v in batch.items()}
    path = work / f"wide-{width}x{depth}.stepbundle"
    t0 = time.perf_counter()
    rep = export(Recipe(model, opt, models.mse_step, example, seed=0), path)
    export_s = time.perf_counter() - t0
    del model, opt, example
    npz = work / f"wide-{width}x{depth}-batch.npz"
    np.savez(npz, **batch)
    state_bytes = sum(int(s.spec.numel) * _itemsize(s.spec.dtype) for s in rep.manifest.state)
    info = {
        "model": f"{depth} x (Linear({width}, {width}), GELU), AdamW",
        "export_s": export_s,
        "file_bytes": rep.size,
        "state_bytes": state_bytes,
        "state_tensors": len(rep.manifest.state),
    }
    return path, npz, info


def _itemsize(dtype: Any) -> int:
    from stepbundle.runtime.dtypes import to_numpy

    return int(to_numpy(dtype).itemsize)


def bundle_read_and_rss(
    path: Path, npz: Path, info: dict[str, Any], cfg: dict[str, Any], work: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Bundle read throughput, state transfer at load, and peak RSS with and without donation."""
    reads = [child("read", str(path)) for _ in range(cfg["read_repeats"])]
    cache = work / "wide-cache"
    shutil.rmtree(cache, ignore_errors=True)
    steps = str(cfg["rss_steps"])
    rss: dict[str, Any] = {"model": info["model"], "state_bytes": info["state_bytes"]}
    rss["donate"] = child("rss", str(path), str(npz), str(cache), steps, "--donate")
    rss["no_donate"] = child("rss", str(path), str(npz), str(cache), steps, "--no-donate")
    loads = [rss["donate"], rss["no_donate"]]
    loads += [
        child("rss", str(path), str(npz), str(cache), "1", "--donate")
        for _ in range(cfg["read_repeats"] - 1)
    ]
    state_s = statistics.median(ld["load_stages_s"]["state"] for ld in loads)

    def summary(key: str) -> dict[str, Any]:
        runs = [r[key] for r in reads]
        s = statistics.median(r["total_s"] for r in runs)
        return {"seconds": s, "mb_per_s": runs[0]["file_bytes"] / 1e6 / s, "runs": runs}

    read = {
        **info,
        "read_evicted": summary("evicted"),
        "read_cached": summary("cached"),
        "state_transfer": {
            "seconds": state_s,
            "mb_per_s": info["state_bytes"] / 1e6 / state_s,
            "samples_s": [ld["load_stages_s"]["state"] for ld in loads],
        },
    }
    return read, rss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer depths and rounds (< 2 minutes)")
    ap.add_argument("--out", default=str(ROOT / "build" / "bench"), help="output folder")
    ap.add_argument("--depths", type=int, nargs="*", help="override the MLP depths")
    ap.add_argument("--rounds", type=int, help="override the number of interleaved rounds")
    ap.add_argument("--no-extras", action="store_true", help="step times only")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads for torch_eager and torch_compile (default 1: faster than "
        "the default for these small models, so the stronger baseline; 0 keeps torch's default)",
    )
    args = ap.parse_args(argv)
    git = git_state()  # before anything runs: the tree the figures are measured from
    cfg = dict(QUICK if args.quick else FULL)
    if args.depths:
        cfg["depths"] = args.depths
    if args.rounds:
        cfg["rounds"] = args.rounds
    t_start = time.perf_counter()

    # torch_xla: the XLA device must exist before any CPU autograd runs in the process.
    import torch_xla

    torch_xla.device()
    warnings.filterwarnings("ignore")
    import numpy as np
    import torch

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    cfg["torch_threads"] = torch.get_num_threads()

    import models
    import report

    out = Path(args.out).resolve()
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results: dict[str, Any] = {"machine": machine(), "config": cfg, "git": git}
    phases: dict[str, float] = {"imports": time.perf_counter() - t_start}
    results["phase_s"] = phases
    t_phase = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t_phase
        now = time.perf_counter()
        phases[name] = now - t_phase
        t_phase = now

    cases = [models.Case("mlp", d) for d in cfg["depths"]]
    g = models.GPTConfig(**cfg["gpt"])
    cases.append(models.Case("gpt", g.layers, g))
    results["gpt_config"] = asdict(g)

    exports, bundles = [], {}
    for case in cases:
        batch = models.make_batches(case, 1)[0]
        path = work / f"{case.label}.stepbundle"
        exports.append(export_case(case, batch, path))
        np.savez(work / f"{case.label}-batch.npz", **batch)
        bundles[case.label] = path
        say(
            f"exported {case.label}: {exports[-1]['export_s']:.2f} s, {exports[-1]['graph_inputs']} graph inputs"
        )
    results["export"] = exports
    phase("export")

    records: list[dict[str, Any]] = []
    for case, exp in zip(cases, exports):
        t0 = time.perf_counter()
        recs = time_case(case, bundles[case.label], cfg, work / "cache")
        for r in recs:
            r["graph_inputs"] = exp["graph_inputs"]
        records += recs
        med = {r["method"]: r["median_ms"] for r in recs}
        say(
            f"timed {case.label} in {time.perf_counter() - t0:.0f} s: "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
        )
    results["step_times"] = records
    results["targets"] = report.targets(records)
    phase("step_times")

    diag_cases = [c for c in cases if c.name == "mlp" and c.depth in cfg["diagnostic_depths"]]
    results["diagnostics"] = []
    for case in diag_cases:
        t0 = time.perf_counter()
        d = diagnose(
            case.name,
            case.depth,
            bundles[case.label],
            models.make_batches(case, 4),
            cfg,
            work / "cache",
        )
        results["diagnostics"].append(d)
        say(
            f"diagnosed {case.label} in {time.perf_counter() - t0:.0f} s: "
            + ", ".join(f"{r['method']} {r['median_ms']:.2f} ms" for r in d["records"])
        )

    phase("diagnostics")

    if not args.no_extras:
        load_cases = cases if cfg["load_cases"] == "all" else cases[:1]
        results["load"] = [
            load_times(
                c,
                bundles[c.label],
                work / f"{c.label}-batch.npz",
                work / "load-cache",
                cfg["first_step_torch_xla"],
                cfg["warm_loads"],
            )
            for c in load_cases
        ]
        results["targets"] += report.load_targets(results["load"])
        say("load times measured")
        phase("load")
        wide, npz, info = wide_bundle(cfg["wide"], work)
        say(
            f"exported the wide bundle ({info['state_bytes'] / 1e6:.0f} MB of state) in {info['export_s']:.1f} s"
        )
        results["bundle_read"], results["peak_rss"] = bundle_read_and_rss(
            wide, npz, info, cfg, work
        )
        if cfg["diagnose_wide"]:
            # Packing only small tensors must not slow a model whose state is a few big ones.
            with np.load(npz) as z:
                wide_batch = {k: z[k] for k in z.files}
            d = diagnose(
                "wide",
                int(wide.stem.rsplit("x", 1)[1]),
                wide,
                [wide_batch],
                cfg,
                work / "wide-cache",
                only=("stepbundle", "floor", "floor_execute", "packed_execute"),
                rounds=cfg["wide_rounds"],
            )
            results["diagnostics"].append(d)
            say(
                "diagnosed the wide bundle: "
                + ", ".join(f"{r['method']} {r['median_ms']:.1f} ms" for r in d["records"])
            )
        say("bundle read and peak RSS measured")
        wide.unlink()
        phase("wide_bundle")

    results["machine"]["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results["wall_s"] = time.perf_counter() - t_start
    paths = report.write(results, out)
    print()
    print(report.markdown(results))
    print(
        f"wrote {paths['json']}, {paths['markdown']}, {paths['plot']} in {results['wall_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
