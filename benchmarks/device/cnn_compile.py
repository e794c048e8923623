"""examples/cifar_cnn.py's compile times on the device: the bundle against the same CNN in JAX.

    python benchmarks/device/cnn_compile.py BUNDLE --platform tpu --rounds 5 --out cnn.json

Issue #28 asks for the CNN's train program to compile in at most 3x its eval program's
time. This measures, one compile at a time and in alternating rounds, the bundle's train
and eval entries as the runtime loads them (``CompileOptions(cache_dir=False)``) next to the
same model and step written by hand in JAX (``jax.jit(...).lower(...).compile()`` of a
freshly made function each round, so that nothing is cached): three blocks of 3x3
convolution without bias, BatchNorm (batch statistics, running ones updated), ReLU and
2x2 max-pool over widths 8, 16, 32, a global average pool, dropout 0.2, a linear head,
cross-entropy with label smoothing 0.1, clipping to norm 1, and AdamW with weight decay
5e-4 on the conv and linear weights only; eval: running statistics, loss and accuracy.
Images arrive as uint8 NHWC, as they do in the bundle (the peer stays NHWC; its learning
rate is a constant where the bundle takes it as an input). The ratio of each pair says
whether the train/eval ratio belongs to the bundle or to the model.

The bundles' rounds run first (train and eval of each, alternating), then the peer's;
the committed cnn_compile.json was measured by an earlier version that compiled the
peer inside the first two rounds, whose bundle times (5.6 and 4.9 s against 3.9, 1.9
and 2.4 s after) it may have slowed. ``--fresh N`` first compiles the bundle's entries
in N fresh processes per order (eval then train, train then eval), as a user meets them,
with ``--efforts`` also under XLA's ``exec_time_optimization_effort``.

Imports: jax, optax, numpy, stepbundle.runtime.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions

BATCH, CLASSES, WIDTHS = 64, 10, (8, 16, 32)
MEAN = (125.3, 123.0, 113.9)
STD = (63.0, 62.1, 66.7)


def jax_steps() -> tuple[Any, Any, Any]:
    """(train, eval, (params, stats, opt_state)) of the hand-written CNN, not yet jitted."""
    import jax
    import jax.numpy as jnp
    import optax

    key = jax.random.key(0)
    params: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    c_in = 3
    for i, c in enumerate(WIDTHS):
        key, sub = jax.random.split(key)
        params[f"conv{i}"] = jax.random.normal(sub, (3, 3, c_in, c)) * (2.0 / (9 * c_in)) ** 0.5
        params[f"bn{i}.scale"], params[f"bn{i}.bias"] = jnp.ones(c), jnp.zeros(c)
        stats[f"bn{i}.mean"], stats[f"bn{i}.var"] = jnp.zeros(c), jnp.ones(c)
        c_in = c
    key, sub = jax.random.split(key)
    params["head.weight"] = jax.random.normal(sub, (c_in, CLASSES)) * c_in**-0.5
    params["head.bias"] = jnp.zeros(CLASSES)
    decay = {k: v.ndim > 1 for k, v in params.items()}
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(3e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=5e-4, mask=decay),
    )
    mean, std = jnp.asarray(MEAN), jnp.asarray(STD)

    def forward(p: Any, s: Any, images: Any, train: bool, key: Any) -> Any:
        x = (images.astype(jnp.float32) - mean) / std
        new = {}
        for i in range(len(WIDTHS)):
            x = jax.lax.conv_general_dilated(
                x, p[f"conv{i}"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            if train:
                m, v = x.mean((0, 1, 2)), x.var((0, 1, 2))
                n = x.shape[0] * x.shape[1] * x.shape[2]
                new[f"bn{i}.mean"] = 0.9 * s[f"bn{i}.mean"] + 0.1 * m
                new[f"bn{i}.var"] = 0.9 * s[f"bn{i}.var"] + 0.1 * v * n / (n - 1)
            else:
                m, v = s[f"bn{i}.mean"], s[f"bn{i}.var"]
            x = (x - m) * jax.lax.rsqrt(v + 1e-5) * p[f"bn{i}.scale"] + p[f"bn{i}.bias"]
            x = jax.nn.relu(x)
            x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        x = x.mean((1, 2))
        if train:
            keep = jax.random.bernoulli(key, 0.8, x.shape)
            x = jnp.where(keep, x / 0.8, 0.0)
        return x @ p["head.weight"] + p["head.bias"], new

    def train(carry: Any, images: Any, labels: Any, key: Any) -> Any:
        p, s, o = carry

        def loss_fn(p: Any) -> Any:
            logits, new = forward(p, s, images, True, key)
            target = optax.smooth_labels(jax.nn.one_hot(labels, CLASSES), 0.1)
            return optax.softmax_cross_entropy(logits, target).mean(), (logits, new)

        (loss, (logits, new)), g = jax.value_and_grad(loss_fn, has_aux=True)(p)
        norm = optax.global_norm(g)
        u, o = tx.update(g, o, p)
        accuracy = (logits.argmax(-1) == labels).mean()
        return (optax.apply_updates(p, u), new, o), (loss, accuracy, norm)

    def evaluate(carry: Any, images: Any, labels: Any) -> Any:
        p, s, _ = carry
        logits, _ = forward(p, s, images, False, None)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, (logits.argmax(-1) == labels).mean()

    return train, evaluate, (params, stats, tx.init(params))


def compile_jax(which: str) -> float:
    """Seconds to compile a freshly built ``which`` (train or eval) of the JAX CNN."""
    import jax
    import jax.numpy as jnp

    train, evaluate, carry = jax_steps()
    images = jax.ShapeDtypeStruct((BATCH, 32, 32, 3), jnp.uint8)
    labels = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    if which == "train":
        lowered = jax.jit(train, donate_argnums=0).lower(carry, images, labels, jax.random.key(1))
    else:
        lowered = jax.jit(evaluate).lower(carry, images, labels)
    t0 = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - t0


def child(a: argparse.Namespace) -> int:
    """One fresh process: the bundle's entries compiled in ``--child``'s order, as JSON."""
    from stepbundle.runtime import _compat, load

    if a.effort is not None:  # XLA's exec_time_optimization_effort, -1..1 (0: XLA's default)
        make = _compat.compile_options

        def with_effort(*args: Any, **kw: Any) -> Any:
            opts = make(*args, **kw)
            opts.executable_build_options.exec_time_optimization_effort = a.effort
            return opts

        _compat.compile_options = with_effort  # runtime/compile/program.py calls it through _compat
    out = {}
    for entry in a.child.split(","):
        t = load(
            a.bundle,
            device=a.platform,
            options=LoadOptions(compile=CompileOptions(entries=entry, cache_dir=False)),
        )
        out[entry] = float(t.load_info.seconds["compile"])
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def fresh(a: argparse.Namespace) -> dict[str, Any]:
    """Compile times in fresh processes, as a user meets them: each order ``--fresh`` times."""
    import subprocess
    import sys

    rows: dict[str, list[dict[str, float]]] = {}
    for i in range(a.fresh):
        for order in ("eval,train", "train,eval"):
            for effort in (None, *a.efforts):
                cmd = [sys.executable, __file__, a.bundle, "--child", order]
                cmd += [] if a.platform is None else ["--platform", a.platform]
                cmd += [] if effort is None else ["--effort", str(effort)]
                done = subprocess.run(cmd, capture_output=True, text=True)
                key = order + ("" if effort is None else f" effort={effort}")
                if done.returncode or "RESULT " not in done.stdout:
                    got = {"error": done.stderr[-600:]}
                else:
                    got = json.loads(done.stdout.split("RESULT ", 1)[1])
                rows.setdefault(key, []).append(got)
                print(f"fresh {i} {key:28s} " + json.dumps(got), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle")
    p.add_argument("--platform", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--jax-rounds", type=int, default=None, help="rounds of the JAX peer (default: all)"
    )
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME=BUNDLE",
        help="another bundle of the same model (e.g. another optimizer), train and eval",
    )
    p.add_argument("--fresh", type=int, default=0, help="also N fresh processes per order")
    p.add_argument("--efforts", type=float, nargs="*", default=[], help="with --fresh: also these")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--effort", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.child:
        return child(a)
    # Before this process takes the device: a TPU is one process's at a time.
    fresh_rows = fresh(a) if a.fresh else {}
    import jax

    from stepbundle.runtime import load

    platform = a.platform or jax.default_backend()
    jax.config.update("jax_platform_name", platform)

    def bundle(path: str, entry: str) -> float:
        t = load(
            path,
            device=platform,
            options=LoadOptions(compile=CompileOptions(entries=entry, cache_dir=False)),
        )
        return float(t.load_info.seconds["compile"])

    runs: dict[str, Any] = {}
    for name, path in (("bundle", a.bundle), *(e.split("=", 1) for e in a.extra)):
        for entry in ("train", "eval"):
            runs[f"{name}_{entry}"] = lambda path=path, entry=entry: bundle(path, entry)
    runs["jax_train"] = lambda: compile_jax("train")
    runs["jax_eval"] = lambda: compile_jax("eval")
    jax_rounds = a.rounds if a.jax_rounds is None else a.jax_rounds
    bundle(a.bundle, "eval")  # the compiler's warm-up
    compile_jax("eval")
    times: dict[str, list[float]] = {k: [] for k in runs}
    # The bundles' rounds first, then the JAX peer's: each round of one does the same work.
    schedule = [(r, n) for r in range(a.rounds) for n in runs if not n.startswith("jax_")]
    schedule += [(r, n) for r in range(jax_rounds) for n in runs if n.startswith("jax_")]
    for r, name in schedule:
        times[name].append(runs[name]())
        print(f"round {r} {name:14s} compile {times[name][-1]:6.2f} s", flush=True)
    med = {k: float(np.median(v)) for k, v in times.items() if v}
    report = {
        "bundle": a.bundle,
        "jax": jax.__version__,
        "device_kind": jax.devices(platform)[0].device_kind,
        "rounds": a.rounds,
        "compile_s": times,
        "median_s": med,
        "train_over_eval": {
            k[: -len("_train")]: med[k] / med[k[: -len("train")] + "eval"]
            for k in med
            if k.endswith("_train")
        },
        "train_over_eval_per_round": {
            k[: -len("_train")]: [
                t / e for t, e in zip(times[k], times[k[: -len("train")] + "eval"], strict=True)
            ]
            for k in med
            if k.endswith("_train")
        },
        "fresh_processes": fresh_rows,
        "bundle_over_jax": {
            e: med[f"bundle_{e}"] / med[f"jax_{e}"] for e in ("train", "eval") if f"jax_{e}" in med
        },
    }
    for k, v in med.items():
        print(f"{k:14s} {v:6.2f} s")
    print("train/eval: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["train_over_eval"].items()))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
