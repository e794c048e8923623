"""The Python half of scripts/device_check.sh: golden bundles, K steps per call and step
times on one accelerator, written to one JSON file.

    python benchmarks/device/check.py --platform tpu --out device_check.json

Every number is measured in this process on the device it names; nothing is asserted,
everything is recorded (a golden bundle's relative error, whether K steps per call
matched single steps bit for bit, compile seconds, step times), and the script exits 1
when a golden bundle's metrics are off by more than 1e-5 under "highest" or K steps per
call differ (state gaps are recorded, not judged).

Imports: jax, numpy, stepbundle.runtime, tests/runtime/runtime_helpers (the golden files).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from runtime_helpers import (  # noqa: E402
    GOLDEN_SCHEDULES,
    GOLDEN_STEPS,
    golden_batches,
    golden_bundle,
    golden_expected,
    golden_names,
    golden_versions,
    rel,
)

from stepbundle.runtime import CompileOptions, LoadOptions, _compat, load  # noqa: E402
from stepbundle.runtime.compile import rewrites  # noqa: E402
from stepbundle.schema.reader import open_bundle  # noqa: E402
from stepbundle.stablehlo import artifact as mlir  # noqa: E402
from stepbundle.stablehlo.pow_precision import rewrite_powers  # noqa: E402


def trainer(platform_: str, name: str, version: Any = None, **kw: Any) -> Any:
    t = load(golden_bundle(name, version), platform_, LoadOptions.from_keywords(**kw))
    if name in GOLDEN_SCHEDULES:
        t.set_schedule("lr", GOLDEN_SCHEDULES[name])
    return t


def metric_errors(ms: list[dict[str, Any]], exp: dict[str, np.ndarray]) -> dict[str, float]:
    """Each metric's largest relative error over the steps run, against the expected."""
    return {
        f"metric/{k}": rel(np.array([float(m[k]) for m in ms]), exp[f"metric/{k}"]) for k in ms[0]
    }


def golden(platform_: str, out: dict[str, Any]) -> bool:
    ok = True
    for version in golden_versions():
        for name in golden_names(version):
            t0 = time.perf_counter()
            t = trainer(platform_, name, version, matmul_precision="highest")
            load_s = time.perf_counter() - t0
            exp = golden_expected(name, version)
            ms = t.run(golden_batches(name, version), GOLDEN_STEPS[name])
            errs = metric_errors(ms, exp)
            state = t.state_dict()
            errs.update(
                {
                    k: rel(state[k[6:]], v)
                    for k, v in exp.items()
                    if k.startswith("state/") and k[6:] in state
                }
            )
            worst_key = max(errs, key=lambda k: errs[k])
            worst = errs[worst_key]
            metrics = max(v for k, v in errs.items() if k.startswith("metric/"))
            # The metrics must match the CPU's; the state is recorded (an accelerator's
            # float32 division and square roots round otherwise, and Adam's update divides
            # by sqrt(v) of gradients near zero, so small state entries move most).
            ok &= metrics <= 1e-5
            out["golden"].append(
                {
                    "version": list(version),
                    "bundle": name,
                    "max_rel": worst,
                    "metrics_max_rel": metrics,
                    "worst": worst_key,
                    "within_1e-5": worst <= 1e-5,
                    "first_loss": float(ms[0]["loss"]),
                    "losses": [float(m["loss"]) for m in ms],
                    "expected_losses": [float(v) for v in exp["metric/loss"]],
                    "expected_first_loss": float(exp["metric/loss"][0]),
                    "load_s": load_s,
                    "compile_s": t.load_info.seconds.get("compile"),
                }
            )
            print(
                f"golden v{version[0]}.{version[1]} {name}: metrics max rel {metrics:.2e}, all "
                f"{worst:.2e} ({worst_key}), "
                f"compile {t.load_info.seconds.get('compile', float('nan')):.2f} s",
                flush=True,
            )
    return ok


def without_power_precision(platform_: str, out: dict[str, Any]) -> None:
    """The newest golden bundles again with the runtime's ``power-precision`` rewrite
    dropped: what the rewrite changes on this device (stablehlo/pow_precision.py)."""
    version = golden_versions()[-1]
    kept = rewrites.REWRITES
    rewrites.REWRITES = tuple((n, r) for n, r in kept if n != "power-precision")
    try:
        for name in golden_names(version):
            t = trainer(platform_, name, version, matmul_precision="highest")
            exp = golden_expected(name, version)
            ms = t.run(golden_batches(name, version), GOLDEN_STEPS[name])
            err = max(metric_errors(ms, exp).values())
            out["without_power_precision"].append(
                {"version": list(version), "bundle": name, "metrics_max_rel": err}
            )
            print(f"golden v{version[0]}.{version[1]} {name} without power-precision: {err:.2e}")
    finally:
        rewrites.REWRITES = kept


def _rewritten_power(platform_: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x**y (float32 vectors) as the runtime computes it under "highest" on an
    accelerator: a power op put through stablehlo/pow_precision.py, compiled here."""
    n = len(x)
    with open_bundle(golden_bundle("linear_adamw")) as b:  # any module: its MLIR context
        like = mlir.parse_artifact(
            bytes(b.section(b.manifest.entries["train"].programs[0].section))
        )
    t = f"tensor<{n}xf32>"
    module = mlir.Module.parse_text(
        like,
        f"func.func @main(%x: {t}, %y: {t}) -> {t} {{\n"
        f"  %p = stablehlo.power %x, %y : {t}\n  return %p : {t}\n}}",
    )
    assert rewrite_powers(module, max_elements=n) == 1
    client = _compat.get_client(platform_)
    device = client.local_devices()[0]
    exe = _compat.compile_bytecode(
        client, module.bytecode(), [device], _compat.compile_options(1, [device.id])
    )
    return np.asarray(exe.execute([jax.device_put(v, device) for v in (x, y)])[0])


def adam_powers(platform_: str, out: dict[str, Any]) -> None:
    """Adam's bias corrections, 1 - beta**step, on the device against float64.

    The golden bundles with Adam drifted from the CPU by 3-4e-5 under "highest" where
    SGD stayed under 1e-5 (first December run). In float64 on a CPU, beta2**step one
    float32 ulp off moves linear_adamw's losses by 4e-6. This records, step by step, how
    many ulp off the exact power the device's float32 power is (``f32``), jax's float64
    power rounded to float32 (``f64``), and the runtime's exact power under "highest"
    (``rewrite``: stablehlo/pow_precision.py's binary exponentiation, compiled here).
    """
    dev = jax.devices(platform_)[0]
    # Up to 10**4: 0.999**1e5 is a float32 subnormal, which XLA flushes to zero everywhere.
    steps = np.concatenate([np.arange(1, 65), [100, 1000, 10000]]).astype(np.float32)
    rec: dict[str, Any] = {"steps": steps.tolist()}
    for beta in (0.9, 0.999):
        b32 = np.float32(beta)
        exact = np.float64(b32) ** steps.astype(np.float64)
        exact = np.where(exact < np.finfo(np.float32).tiny, 0.0, exact)  # flushed
        spacing = np.spacing(exact.astype(np.float32)).astype(np.float64)
        got32 = np.asarray(jax.jit(lambda s, b=b32: b**s)(jax.device_put(steps, dev)))
        with _compat.x64_scope():
            wide = jax.jit(lambda s, b=b32: jnp.float64(b) ** s.astype(jnp.float64))
            got64 = np.asarray(wide(jax.device_put(steps, dev)).astype(jnp.float32))
        rewritten = _rewritten_power(platform_, np.full_like(steps, b32), steps)
        for label, got in (("f32", got32), ("f64", got64), ("rewrite", rewritten)):
            ulp = np.abs(got.astype(np.float64) - exact) / spacing
            rec[f"{beta}/{label}"] = {"max_ulp": float(ulp.max()), "ulp": ulp.tolist()}
            print(f"{beta}**step in {label} on the device: at most {ulp.max():.2f} ulp off")
    out["adam_powers"] = rec


def steps_per_call(platform_: str, out: dict[str, Any]) -> bool:
    ok = True
    for name in ("linear_adamw", "dropout_sgd", "batchnorm_lr"):
        one, many = trainer(platform_, name), trainer(platform_, name, steps_per_call=4)
        b = golden_batches(name)
        m1, m4 = one.run(b, 11), many.run(b, 11)
        same = all(
            np.array_equal(np.asarray(x[k]), np.asarray(y[k])) for x, y in zip(m1, m4) for k in x
        )
        s1, s4 = one.state_dict(), many.state_dict()
        same_state = all(np.array_equal(s1[k], s4[k]) for k in s1)
        ok &= same and same_state
        out["steps_per_call"].append(
            {
                "bundle": name,
                "metrics_identical": same,
                "state_identical": same_state,
                "compile_s_k1": one.load_info.seconds.get("compile"),
                "compile_s_k4": many.load_info.seconds.get("compile"),
            }
        )
        print(f"steps_per_call=4 {name}: metrics identical {same}, state identical {same_state}")
    return ok


def step_times(platform_: str, out: dict[str, Any]) -> None:
    for name in ("linear_adamw", "batchnorm_lr"):
        b = golden_batches(name)
        for k in (1, 8, 32):
            t = trainer(platform_, name, steps_per_call=k)
            n = 32 * 8
            t.run(b, 64, keep_metrics=False)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                last = t.run(b, n, keep_metrics=False)
                float(last[-1]["loss"])
                times.append((time.perf_counter() - t0) / n * 1e3)
            out["step_ms"].append(
                {
                    "bundle": name,
                    "steps_per_call": k,
                    "median_ms": float(np.median(times)),
                    "samples_ms": times,
                    "auto_steps_per_call": getattr(t.load_info, "steps_per_call", None),
                }
            )
            print(f"{name} steps_per_call={k}: {np.median(times):.4f} ms/step", flush=True)


def cnn(platform_: str, bundle: str, data: str, out: dict[str, Any]) -> None:
    """A CNN bundle (examples/cifar_cnn.py): each entry's compile time on the device, and
    8 training steps on the device against the same steps on this machine's CPU."""
    with np.load(data) as z:
        arrays = {k: z[k] for k in z.files}
    batches = [{k: v[i] for k, v in arrays.items()} for i in range(len(arrays["x"]))]
    rec: dict[str, Any] = {"bundle": bundle}
    for entry in ("eval", "train"):
        t0 = time.perf_counter()
        t = load(
            bundle,
            device=platform_,
            options=LoadOptions(compile=CompileOptions(entries=entry, cache_dir=False)),
        )
        rec[f"{entry}_load_s"] = time.perf_counter() - t0
        rec[f"{entry}_compile_s"] = t.load_info.seconds.get("compile")
    dev = load(
        bundle,
        device=platform_,
        options=LoadOptions(
            compile=CompileOptions(entries="train", cache_dir=False, matmul_precision="highest")
        ),
    )
    cpu = load(
        bundle,
        device="cpu",
        options=LoadOptions(compile=CompileOptions(entries="train", cache_dir=False)),
    )
    m_dev = dev.run(batches, len(batches))
    m_cpu = cpu.run(batches, len(batches))
    loss_dev = np.array([float(m["loss"]) for m in m_dev])
    loss_cpu = np.array([float(m["loss"]) for m in m_cpu])
    rec["losses_device"] = loss_dev.tolist()
    rec["losses_cpu"] = loss_cpu.tolist()
    rec["max_rel_loss"] = float(np.max(np.abs(loss_dev - loss_cpu) / np.abs(loss_cpu)))
    out["cnn"] = rec
    print(
        f"cnn: compile eval {rec['eval_compile_s']:.2f} s, train {rec['train_compile_s']:.2f} s "
        f"({rec['train_compile_s'] / rec['eval_compile_s']:.1f}x); 8 steps vs CPU: max rel loss "
        f"{rec['max_rel_loss']:.2e}",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", required=True)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--cnn",
        nargs=2,
        metavar=("BUNDLE", "DATA_NPZ"),
        default=None,
        help="also a CNN bundle and its batches (x, y stacked)",
    )
    a = p.parse_args()
    devs = jax.devices(a.platform)
    out: dict[str, Any] = {
        "jax": jax.__version__,
        "platform": a.platform,
        "device_kind": devs[0].device_kind,
        "devices": [str(d) for d in devs],
        "python": platform.python_version(),
        "golden": [],
        "steps_per_call": [],
        "step_ms": [],
        "without_power_precision": [],
    }
    t0 = time.perf_counter()
    ok = golden(a.platform, out)
    adam_powers(a.platform, out)
    without_power_precision(a.platform, out)
    ok &= steps_per_call(a.platform, out)
    step_times(a.platform, out)
    if a.cnn:
        cnn(a.platform, a.cnn[0], a.cnn[1], out)
    out["seconds"] = time.perf_counter() - t0
    out["ok"] = ok
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"device_check: {'ok' if ok else 'FAILED'} in {out['seconds']:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
