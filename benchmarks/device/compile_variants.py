"""A bundle's compile time per entry as the runtime loads it, and with its rewrites varied.

    python benchmarks/device/compile_variants.py BUNDLE --platform tpu --out variants.json

Every variant is a ``CompileOptions(cache_dir=False)`` of one entry, with a load option or the
runtime's rewrite pipeline (``runtime/compile/rewrites.py``) changed in one way: a rewrite
dropped, or a family of operations zeroed before the rewrites that follow (its
operands then feed nothing and XLA drops them, so the time it leaves is what that family
costs the compiler). Variants compile one after another in this process, in ``--rounds``
rounds, and the median of each is reported next to the eval entry's, as the ratio the
issue asks about (issue #28: the CNN's train program at most 3x its eval program).

``--data NPZ`` also times ``--steps`` train steps of each train variant (``step_ms``).
Before each load a marker goes to stderr: with libtpu's pass log on, ``compile_passes.py``
sums each variant's HLO pass times.

Where ``compile_bisect.py`` found the cause (variants of the bundle's own program compiled
in parallel threads), this measures the fix as a user meets it, one compile at a time.
Imports: jax, numpy, stepbundle.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from stepbundle.runtime import load
from stepbundle.runtime.compile import rewrites
from stepbundle.stablehlo import artifact as mlir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_bisect import _zero_ops  # noqa: E402

from stepbundle.runtime import CompileOptions, LoadOptions


def _zeroing(op: str, pick: Any = lambda line: True) -> rewrites.Rewrite:
    def rewrite(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        text, _ = _zero_ops(stage.module.text(), op, pick)
        return rewrites.Stage(mlir.Module.parse_text(stage.module, text), stage.program)

    return rewrite


def _batched_powers(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
    """The program's powers batched into one backend power (no float64)."""
    from stepbundle.stablehlo.pow_precision import rewrite_powers

    rewrite_powers(stage.module, exact=False)
    return stage


def _wgrad_positions(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
    """Weight gradients as one product per output position (the runtime's form before the
    row loop: 5-7 s against its 2.5-3.5 s), on TPUs."""
    from stepbundle.stablehlo.conv_wgrad import rewrite_weight_gradients

    if ctx.platform == "tpu":
        rewrite_weight_gradients(stage.module, form="positions")
    return stage


def _without(name: str) -> tuple[tuple[str, rewrites.Rewrite], ...]:
    return tuple((n, r) for n, r in rewrites.REWRITES if n != name)


def _with(
    where: str, name: str, extra: rewrites.Rewrite
) -> tuple[tuple[str, rewrites.Rewrite], ...]:
    """The runtime's pipeline with ``extra`` "before", "after" or "instead of" rewrite ``name``."""
    out: list[tuple[str, rewrites.Rewrite]] = []
    for n, r in rewrites.REWRITES:
        if n != name:
            out.append((n, r))
        elif where == "instead of":
            out.append((n, extra))
        elif where == "before":
            out += [(f"before-{n}", extra), (n, r)]
        else:
            out += [(n, r), (f"after-{n}", extra)]
    return tuple(out)


def variants() -> dict[str, tuple[str, tuple[tuple[str, rewrites.Rewrite], ...], dict[str, Any]]]:
    """name -> (entry, rewrite pipeline, load options)."""
    wgrad = lambda s: "[f, b, 0, 1]x" in s  # noqa: E731  (torch_xla's weight gradients)
    dgrad = lambda s: "x[0, 1, o, i]" in s  # noqa: E731  (its input gradients)
    base = rewrites.REWRITES
    return {
        "eval": ("eval", base, {}),
        "train": ("train", base, {}),
        # "highest" also computes Adam's powers exactly (stablehlo/pow_precision.py)
        "train_highest": ("train", base, {"matmul_precision": "highest"}),
        "train_highest_no_power_precision": (
            "train",
            _without("power-precision"),
            {"matmul_precision": "highest"},
        ),
        "train_no_wgrad": (
            "train",
            _with("before", "weight-gradients", _zeroing("convolution", wgrad)),
            {},
        ),
        # what else in the train program costs the compiler time: one family zeroed each
        "train_no_dgrad": (
            "train",
            _with("before", "weight-gradients", _zeroing("convolution", dgrad)),
            {},
        ),
        "train_no_dot": ("train", _with("after", "weight-gradients", _zeroing("dot_general")), {}),
        "train_no_select_and_scatter": (
            "train",
            _with("before", "weight-gradients", _zeroing("select_and_scatter")),
            {},
        ),
        "train_power_batched": (
            "train",
            _with("instead of", "power-precision", _batched_powers),
            {},
        ),
        "train_no_power": ("train", _with("before", "weight-gradients", _zeroing("power")), {}),
        "train_no_onehot_rewrite": ("train", _without("onehot-sums"), {}),
        "train_wgrad_positions": (
            "train",
            _with("instead of", "weight-gradients", _wgrad_positions),
            {},
        ),
        "train_wgrad_convolution": ("train", _without("weight-gradients"), {}),
        "train_no_reduce": ("train", _with("before", "weight-gradients", _zeroing("reduce")), {}),
        "train_no_gather": ("train", _with("after", "weight-gradients", _zeroing("gather")), {}),
    }


def _resident_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle")
    p.add_argument("--platform", default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--data", default=None, help="an .npz of batches: also time train steps")
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    batches: list[dict[str, Any]] = []
    if a.data:
        with np.load(a.data) as z:
            arrays = {k: z[k] for k in z.files}
        batches = [{k: v[i] for k, v in arrays.items()} for i in range(len(arrays["x"]))]
    step_ms: dict[str, list[float]] = {}
    platform = a.platform or jax.default_backend()
    table = variants()
    if a.only:
        table = {k: v for k, v in table.items() if k in a.only or k == "eval"}
    original = rewrites.REWRITES
    kept = False
    times: dict[str, list[float]] = {k: [] for k in table}
    errors: dict[str, str] = {}
    load(
        a.bundle,
        device=platform,
        options=LoadOptions(compile=CompileOptions(entries="eval", cache_dir=False)),
    )  # the compiler's warm-up
    for r in range(a.rounds):
        for name, (entry, pipeline, options) in table.items():
            rewrites.REWRITES = pipeline
            # A marker in stderr: with libtpu's pass log on (TPU_VMODULE=hlo_pass_pipeline=1)
            # its lines follow, and compile_passes.py sums them per variant.
            print(f"[compile_variants] {name} round {r}", file=sys.stderr, flush=True)
            try:
                t = load(
                    a.bundle,
                    platform,
                    LoadOptions.from_keywords(entry=entry, cache_dir=False, **options),
                )
                kept = kept or t.load_info.kept_freed_memory
                times[name].append(float(t.load_info.seconds["compile"]))
                if batches and entry == "train":
                    float(t.run(batches, 2)[-1]["loss"])  # warm
                    t0 = time.perf_counter()
                    float(t.run(batches, a.steps)[-1]["loss"])
                    step_ms.setdefault(name, []).append((time.perf_counter() - t0) / a.steps * 1e3)
            except Exception as e:  # a variant that does not compile is a finding too
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                rewrites.REWRITES = original
            if times[name]:
                print(f"round {r} {name:30s} compile {times[name][-1]:6.2f} s", flush=True)
    eval_s = float(np.median(times["eval"]))
    report = {
        "bundle": a.bundle,
        "jax": jax.__version__,
        "device_kind": jax.devices(platform)[0].device_kind,
        "rounds": a.rounds,
        # runtime/compile/allocator.py: whether the loads told glibc to keep freed memory, and the
        # process's peak and final resident memory with it
        "kept_freed_memory": bool(kept),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_rss_mb": _resident_mb(),
        "results": [
            {
                "variant": k,
                "compile_s": v,
                "median_s": float(np.median(v)) if v else None,
                "ratio_to_eval": float(np.median(v)) / eval_s if v else None,
                "error": errors.get(k),
                "step_ms": float(np.median(step_ms[k])) if k in step_ms else None,
            }
            for k, v in times.items()
        ],
    }
    for row in report["results"]:
        if row["median_s"] is not None:
            print(f"{row['variant']:30s} {row['median_s']:6.2f} s  {row['ratio_to_eval']:.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
