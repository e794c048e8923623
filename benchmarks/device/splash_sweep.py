"""The fused attention's kernels alone, under other block sizes and layouts, on the device.

    python benchmarks/device/splash_sweep.py --out sweep.json --best best.json

Times exactly the function the runtime splices into a program
(``runtime/fused_attention.attention_function``: the scale, the reshapes, the swap of
``kt``, splash's kernels under ``jax.vmap``) at the 55M GPT's shapes of
``benchmarks/device/gpt.py`` (batch 16, 12 heads, context 512, head size 64, bf16,
causal), forward alone and forward with backward, under each entry of ``CONFIGS``
(``fused_attention.TUNING``'s fields). Each is compiled, warmed and timed in ``--rounds``
rounds of ``--calls`` calls; the median per call is reported. ``--best`` then combines
the fastest forward-only change, the fastest backward change and the fastest layout,
times the combination, and writes whichever tuning of all was fastest forward with
backward (however small its lead: try it in the whole step with ``gpt.py bench
--variant best=@best.json``). The runtime's defaults are the ``default`` row; the
committed splash_sweep.json was written when they held k and v head-dim-minor, so its
``default`` is that and its layout rows are ``k_seq_minor`` and ``v_seq_minor``.

Imports: jax, numpy, stepbundle.runtime.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime.compile import fused_attention
from stepbundle.stablehlo.attention import Site

FORWARD = {  # fields that change only the forward kernel
    "fwd_kv_compute256": {"block_kv_compute": 256},
    "fwd_kv_compute128": {"block_kv_compute": 128},
    "fwd_q256": {"block_q": 256},
    "fwd_q256_kv256": {"block_q": 256, "block_kv": 256},
}
BACKWARD = {  # fields that change only the backward kernel
    "bwd_256": {"block_q_dkv": 256, "block_kv_dkv": 256},
    "bwd_q256": {"block_q_dkv": 256},
    "bwd_kv256": {"block_kv_dkv": 256},
    "bwd_kv_compute256": {"block_kv_dkv_compute": 256},
    "bwd_unfused": {"use_fused_bwd_kernel": False, "block_q_dq": 512, "block_kv_dq": 512},
}
LAYOUTS = {  # the runtime's default holds k and v sequence-minor
    "k_head_dim_minor": {"k_layout": "HEAD_DIM_MINOR"},
    "v_head_dim_minor": {"v_layout": "HEAD_DIM_MINOR"},
    "kv_head_dim_minor": {"k_layout": "HEAD_DIM_MINOR", "v_layout": "HEAD_DIM_MINOR"},
}
CONFIGS: dict[str, dict[str, Any]] = {"default": {}, **LAYOUTS, **FORWARD, **BACKWARD}


def site(b: int, h: int, t: int, d: int) -> Site:
    none: Any = None
    return Site(b, h, t, d, "bf16", "f32", True, none, none, none, none, none, do=none)


def time_config(tuning: dict[str, Any], shape: tuple[int, int, int, int], a: Any) -> Any:
    import jax
    import jax.numpy as jnp

    b, h, t, d = shape
    attention = fused_attention.attention_function(site(*shape), a.interpret, tuning)
    key = jax.random.split(jax.random.key(0), 4)
    q, v, do = (jax.random.normal(k, (b * h, t, d), jnp.bfloat16) for k in key[:3])
    kt = jax.random.normal(key[3], (b * h, d, t), jnp.bfloat16)
    scale = jnp.float32(d**-0.5)
    fwd = jax.jit(attention)

    @jax.jit
    def both(q: Any, kt: Any, v: Any, do: Any) -> Any:
        out, pullback = jax.vjp(lambda q, kt, v: attention(q, kt, v, scale), q, kt, v)
        return out, pullback(do)

    row: dict[str, Any] = {"tuning": tuning}
    for name, call in (
        ("fwd", lambda: fwd(q, kt, v, scale)),
        ("fwd_bwd", lambda: both(q, kt, v, do)),
    ):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        row[f"{name}_compile_s"] = time.perf_counter() - t0
        for _ in range(3):
            jax.block_until_ready(call())
        samples = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            for _ in range(a.calls):
                r = call()
            jax.block_until_ready(r)
            samples.append((time.perf_counter() - t0) / a.calls * 1e3)
        row[f"{name}_ms"] = float(np.median(samples))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="16,12,512,64", help="batch, heads, context, head size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--interpret", action="store_true", help="Pallas's interpreter (a CPU check)")
    p.add_argument("--best", default=None, help="write the fastest tuning (JSON) here")
    a = p.parse_args()
    shape = tuple(int(x) for x in a.shape.split(","))
    rows: dict[str, Any] = {}

    def run(name: str, tuning: dict[str, Any]) -> None:
        try:
            rows[name] = time_config(tuning, shape, a)  # type: ignore[arg-type]
            r = rows[name]
            print(
                f"{name:20s} fwd {r['fwd_ms']:7.3f} ms  fwd+bwd {r['fwd_bwd_ms']:7.3f} ms",
                flush=True,
            )
        except Exception as e:  # a tuning the kernels reject is a finding too
            rows[name] = {"tuning": tuning, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:20s} {rows[name]['error']}", flush=True)

    for name, tuning in CONFIGS.items():
        run(name, tuning)
    ok = {k: r for k, r in rows.items() if "error" not in r}
    if "default" not in ok:  # nothing to compare against: keep the errors, fail
        if a.out:
            Path(a.out).write_text(json.dumps({"results": rows}, indent=1))
        return 1
    fwd = min((k for k in ok if k in FORWARD or k == "default"), key=lambda k: ok[k]["fwd_ms"])
    bwd = min(
        (k for k in ok if k in BACKWARD or k == "default"),
        key=lambda k: ok[k]["fwd_bwd_ms"] - ok[k]["fwd_ms"],
    )
    layout = min(
        (k for k in ok if k in LAYOUTS or k == "default"),
        key=lambda k: ok[k]["fwd_bwd_ms"],
    )
    combined = {**CONFIGS[fwd], **CONFIGS[bwd], **CONFIGS[layout]}
    if sum(x != "default" for x in (fwd, bwd, layout)) > 1:
        run("combined", combined)
    ok = {k: r for k, r in rows.items() if "error" not in r}
    best = min(ok, key=lambda k: ok[k]["fwd_bwd_ms"])
    import jax

    report = {
        "jax": jax.__version__,
        "device_kind": jax.devices()[0].device_kind,
        "shape": shape,
        "rounds": a.rounds,
        "calls": a.calls,
        "best": best,
        "results": rows,
    }
    print(f"fastest forward with backward: {best} {ok[best]['tuning']}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    if a.best:
        Path(a.best).write_text(json.dumps(ok[best]["tuning"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
