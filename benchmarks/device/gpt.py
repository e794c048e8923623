"""A 55M-parameter GPT on one accelerator: the bundle against the same model by hand in JAX.

    # here, with torch_xla (the exporter): a weights-free bundle, 0.2 MB
    .venv/bin/python benchmarks/device/gpt.py export -o build/tpu/gpt55m.stepbundle
    # on the device machine (no torch): both, side by side in one process
    python benchmarks/device/gpt.py bench build/tpu/gpt55m.stepbundle --out gpt.json

The model is benchmarks/models.py's SmallGPT at 6 layers, width 768, 12 heads, a
16,384-token vocabulary, context 512, batch 16, no dropout (so the hand-written peer
computes the same function with no RNG in the way), head tied to the token embedding;
the step runs under bf16 autocast, clips the gradient norm to 1 and takes an AdamW step
(capturable). ``bench`` writes one initial state (numpy, fixed seed: normal(0, 0.02)
weights, zero biases, unit LayerNorm scales), starts the bundle from it
(``StateOptions(init_from=...)``) and the hand-written step from the same arrays, checks that
their first losses agree, then times both in alternating rounds. The JAX peer is what a
JAX user writes: f32 master weights cast to bf16 at each matmul (autocast's rule),
LayerNorm, softmax and the loss in f32, optax AdamW with PyTorch's constants and
clipping, one ``jax.jit`` with the state donated; a second peer swaps its attention for
the Pallas flash-attention kernel jax ships for TPUs, to show what a fused attention
is worth on this model.

MFU counts 6 x (matmul parameters) x tokens plus 12 x layers x context x width x
tokens for attention (the usual estimate, causal masking not discounted) against the
chip's bf16 peak (``--peak-tflops``, 197 for a v5e).

Imports: numpy; jax and optax for ``bench``; torch and stepbundle.exporter for ``export``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

VOCAB, BLOCK, LAYERS, WIDTH, HEADS, BATCH = 16384, 512, 6, 768, 12, 16
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.1, 1.0


# ------------------------------------------------------------------ export (torch)
def recipe() -> Any:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from models import GPTConfig, SmallGPT

    from stepbundle.exporter import Recipe

    def step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
        optimizer.zero_grad()
        with torch.autocast(device_type=batch["idx"].device.type, dtype=torch.bfloat16):
            logits = model(batch["idx"])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, VOCAB), batch["target"].reshape(-1)
        )
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        return {"loss": loss, "grad_norm": grad_norm}

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab=VOCAB, block=BLOCK, layers=LAYERS, width=WIDTH, heads=HEADS, dropout=0.0, batch=BATCH
    )
    model = SmallGPT(cfg)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, capturable=True, foreach=False
    )
    tokens = torch.randint(0, VOCAB, (BATCH, BLOCK + 1))
    return Recipe(
        model=model,
        optimizer=opt,
        step=step,
        include_state=False,
        example_batch={"idx": tokens[:, :-1].contiguous(), "target": tokens[:, 1:].contiguous()},
    )


# ------------------------------------------------------------ the initial state
def initial_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    s = {"wte.weight": normal(VOCAB, WIDTH), "wpe.weight": normal(BLOCK, WIDTH)}
    for i in range(LAYERS):
        p = f"blocks.{i}."
        for name, (o, n) in {
            "qkv": (3 * WIDTH, WIDTH),
            "proj": (WIDTH, WIDTH),
            "fc": (4 * WIDTH, WIDTH),
            "out": (WIDTH, 4 * WIDTH),
        }.items():
            s[p + name + ".weight"] = normal(o, n)
            s[p + name + ".bias"] = np.zeros(o, np.float32)
        for ln in ("ln1", "ln2"):
            s[p + ln + ".weight"] = np.ones(WIDTH, np.float32)
            s[p + ln + ".bias"] = np.zeros(WIDTH, np.float32)
    s["ln_f.weight"] = np.ones(WIDTH, np.float32)
    s["ln_f.bias"] = np.zeros(WIDTH, np.float32)
    return s


def batches(n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(0, VOCAB, size=(BATCH, BLOCK + 1))
        out.append({"idx": t[:, :-1].astype(np.int64), "target": t[:, 1:].astype(np.int64)})
    return out


def step_flops() -> float:
    matmul_params = LAYERS * 12 * WIDTH * WIDTH + VOCAB * WIDTH
    tokens = BATCH * BLOCK
    return 6.0 * matmul_params * tokens + 12.0 * LAYERS * BLOCK * WIDTH * tokens


# ------------------------------------------------------------ the JAX peer
def jax_step(
    state: dict[str, np.ndarray], attn: str = "plain", block: int | None = None
) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    bf16 = jnp.bfloat16
    params = {k: jnp.asarray(v) for k, v in state.items()}

    def linear(p: Any, name: str, x: Any) -> Any:
        y = jnp.einsum("...i,oi->...o", x.astype(bf16), p[name + ".weight"].astype(bf16))
        return y + p[name + ".bias"].astype(bf16)

    def layer_norm(p: Any, name: str, x: Any) -> Any:
        x = x.astype(jnp.float32)
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * p[name + ".weight"] + p[name + ".bias"]

    def attention(q: Any, k: Any, v: Any) -> Any:  # (b, h, t, d) in bf16
        scale = 1.0 / math.sqrt(q.shape[-1])
        if attn == "splash":  # jax's block-sparse kernel: causal blocks above the diagonal skipped
            from jax.experimental.pallas.ops.tpu.splash_attention import (
                splash_attention_kernel as sk,
            )
            from jax.experimental.pallas.ops.tpu.splash_attention import (
                splash_attention_mask as sm,
            )

            t, b_ = q.shape[2], block or 512
            kernel = sk.make_splash_mha(
                mask=sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(q.shape[1])]),
                block_sizes=sk.BlockSizes(
                    block_q=b_,
                    block_kv=b_,
                    block_q_dkv=b_,
                    block_kv_dkv=b_,
                    use_fused_bwd_kernel=True,
                ),
                head_shards=1,
                q_seq_shards=1,
            )
            return jax.vmap(kernel)(q * jnp.asarray(scale, q.dtype), k, v)
        if attn == "flash":
            from jax.experimental.pallas.ops.tpu import flash_attention as fa

            sizes = None
            if block is not None:  # one block over the whole context
                sizes = fa.BlockSizes(
                    block_q=block,
                    block_k_major=block,
                    block_k=block,
                    block_b=1,
                    block_q_major_dkv=block,
                    block_k_major_dkv=block,
                    block_k_dkv=block,
                    block_q_dkv=block,
                    block_k_major_dq=block,
                    block_k_dq=block,
                    block_q_dq=block,
                )
            return fa.flash_attention(q, k, v, causal=True, sm_scale=scale, block_sizes=sizes)
        t = q.shape[2]
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * scale
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(bf16), v)

    def loss_fn(p: Any, idx: Any, target: Any) -> Any:
        b, t = idx.shape
        x = p["wte.weight"][idx] + p["wpe.weight"][:t]
        for i in range(LAYERS):
            pre = f"blocks.{i}."
            qkv = linear(p, pre + "qkv", layer_norm(p, pre + "ln1", x))
            q, k, v = (
                a.reshape(b, t, HEADS, WIDTH // HEADS).transpose(0, 2, 1, 3)
                for a in jnp.split(qkv, 3, axis=-1)
            )
            y = attention(q, k, v).transpose(0, 2, 1, 3).reshape(b, t, WIDTH)
            x = x + linear(p, pre + "proj", y).astype(jnp.float32)
            h = jax.nn.gelu(linear(p, pre + "fc", layer_norm(p, pre + "ln2", x)), approximate=False)
            x = x + linear(p, pre + "out", h).astype(jnp.float32)
        h = layer_norm(p, "ln_f", x).astype(bf16)
        logits = jnp.einsum("bti,vi->btv", h, p["wte.weight"].astype(bf16)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))

    tx = optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY),
    )

    def step(carry: Any, idx: Any, target: Any) -> Any:
        p, o = carry
        loss, g = jax.value_and_grad(loss_fn)(p, idx, target)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss

    return jax.jit(step, donate_argnums=0), (params, tx.init(params))


# ------------------------------------------------------------ bench (device)
def bench(args: argparse.Namespace) -> int:
    import jax
    import jax.profiler

    from stepbundle.runtime import load
    from stepbundle.runtime.options import LoadOptions
    from stepbundle.runtime.state.checkpoint import write_safetensors

    platform = args.platform or jax.default_backend()
    dev = jax.devices(platform)[0]
    init = Path(args.workdir) / "gpt55m-init.safetensors"
    init.parent.mkdir(parents=True, exist_ok=True)
    state = initial_state()
    write_safetensors(init, state)
    data = batches(args.batches)
    out: dict[str, Any] = {
        "jax": jax.__version__,
        "device_kind": dev.device_kind,
        "step_tflop": step_flops() / 1e12,
        "peak_tflops": args.peak_tflops,
        "params": int(sum(v.size for v in state.values())),
    }

    def load_bundle(fused: bool, without: str | None = None) -> Any:
        opts = LoadOptions.from_keywords(
            init_from=init, cache_dir=False, matmul_precision=args.precision
        )
        opts = replace(opts, compile=replace(opts.compile, fused_attention=fused))
        if without is None:
            return load(args.bundle, device=platform, options=opts)
        # The runtime's pipeline less one rewrite (rewrites.py reads REWRITES at each load).
        from stepbundle.runtime.compile import rewrites

        before = rewrites.REWRITES
        rewrites.REWRITES = tuple(r for r in before if r[0] != without)
        try:
            return load(args.bundle, device=platform, options=opts)
        finally:
            rewrites.REWRITES = before

    # Compile seconds from load_info (the programs' compiles, not the state's set-up);
    # the first load of a process also pays the compiler's start-up.
    t0 = time.perf_counter()
    trainer = load_bundle(True)  # the default: a TPU fuses the attention
    out["bundle_load_s"] = time.perf_counter() - t0
    out["bundle_compile_s"] = trainer.load_info.seconds.get("compile")
    out["bundle_fused"] = trainer.load_info.fused_attention
    unfused = None
    if "bundle_unfused" in args.peers.split(","):
        unfused = load_bundle(False)
        out["bundle_unfused_compile_s"] = unfused.load_info.seconds.get("compile")
    variants: dict[str, Any] = {}  # the fused kernels under other block sizes or layouts
    if "bundle_onehot" in args.peers.split(","):
        # The bundle with its one-hot loss sums kept (stablehlo/onehot.py not applied).
        variants["bundle_onehot"] = load_bundle(True, without="onehot-sums")
        out["bundle_onehot_compile_s"] = variants["bundle_onehot"].load_info.seconds.get("compile")
    from stepbundle.runtime.compile import fused_attention
    from stepbundle.stablehlo import onehot

    for spec in args.variant:
        name, _, text = spec.partition("=")
        if name in ("bundle", "bundle_unfused", "bundle_onehot") or name.startswith("jax"):
            raise SystemExit(f"--variant {spec}: {name!r} names a peer; choose another name")
        tuning = json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)
        # {"onehot": {...}} sets stablehlo/onehot.py's TUNING; the rest the kernels'.
        onehot_tuning = tuning.pop("onehot", {})
        before, fused_attention.TUNING = fused_attention.TUNING, tuning
        onehot.TUNING.clear()  # the dict stablehlo/onehot_gather.py reads, in place
        onehot.TUNING.update(onehot_tuning)
        try:
            v = load_bundle(True)
            # A tuning the kernels reject falls back to the traced attention with a
            # warning (runtime/compile/rewrites.py): that is an error here, not a variant.
            if not v.load_info.fused_attention:
                raise ValueError("nothing was fused (the kernels refused this tuning)")
            variants[name] = v
            out[f"{name}_compile_s"] = v.load_info.seconds.get("compile")
            out[f"{name}_tuning"] = tuning
        except Exception as e:  # a variant that fails is recorded, not fatal
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"{name}: {out[f'{name}_error']}", flush=True)
        finally:
            fused_attention.TUNING = before
            onehot.TUNING.clear()
            if onehot_tuning:
                out[f"{name}_tuning"] = {**tuning, "onehot": onehot_tuning}
    # Host batches: the trainer copies them (i64, 128 KiB a step) with its own x64 transfer.
    dev_batches = data

    peers: dict[str, Any] = {}
    for name, attn, block in (
        ("jax", "plain", None),
        ("jax_flash", "flash", None),
        ("jax_flash512", "flash", 512),
        ("jax_splash512", "splash", 512),
        ("jax_splash256", "splash", 256),
        ("jax_splash128", "splash", 128),
    ):
        if name not in args.peers.split(","):
            continue
        if attn != "plain" and platform != "tpu":
            continue
        try:
            t0 = time.perf_counter()
            f, carry = jax_step(state, attn, block)
            dev32 = [
                {k: jax.device_put(v.astype(np.int32), dev) for k, v in b.items()} for b in data
            ]
            carry = jax.device_put(carry, dev)
            carry, loss = f(carry, dev32[0]["idx"], dev32[0]["target"])
            first = float(loss)
            peers[name] = [f, carry, dev32, first]
            out[f"{name}_compile_s"] = time.perf_counter() - t0
            out[f"{name}_first_loss"] = first
        except Exception as e:  # a peer that fails is recorded, not fatal
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"{name}: {out[f'{name}_error']}", flush=True)

    first = trainer.step(dev_batches[0])
    out["bundle_first_loss"] = float(first["loss"])
    if unfused is not None:
        out["bundle_unfused_first_loss"] = float(unfused.step(dev_batches[0])["loss"])
    for name, v in variants.items():
        out[f"{name}_first_loss"] = float(v.step(dev_batches[0])["loss"])
    print(
        f"first loss: bundle {out['bundle_first_loss']:.6f}, "
        + ", ".join(f"{k} {v[3]:.6f}" for k, v in peers.items()),
        flush=True,
    )

    def time_bundle(n: int, which: Any = None) -> float:
        t0 = time.perf_counter()
        m = None
        for i in range(n):
            m = (which or trainer).step(dev_batches[i % len(dev_batches)])
        float(m["loss"])  # type: ignore[index]
        return (time.perf_counter() - t0) / n * 1e3

    def time_peer(name: str, n: int) -> float:
        f, carry, dev32, _ = peers[name]
        t0 = time.perf_counter()
        for i in range(n):
            b = dev32[i % len(dev32)]
            carry, loss = f(carry, b["idx"], b["target"])
        float(loss)
        peers[name][1] = carry
        return (time.perf_counter() - t0) / n * 1e3

    time_bundle(3)
    if unfused is not None:
        time_bundle(3, unfused)
    for v in variants.values():
        time_bundle(3, v)
    for name in peers:
        time_peer(name, 3)
    samples: dict[str, list[float]] = {"bundle": [], **{k: [] for k in peers}}
    if unfused is not None:
        samples["bundle_unfused"] = []
    samples.update({name: [] for name in variants})
    for _ in range(args.rounds):
        samples["bundle"].append(time_bundle(args.steps))
        if unfused is not None:
            samples["bundle_unfused"].append(time_bundle(args.steps, unfused))
        for name, v in variants.items():
            samples[name].append(time_bundle(args.steps, v))
        for name in peers:
            samples[name].append(time_peer(name, args.steps))
    out["ms_per_step"] = {}
    out["mfu"] = {}
    for name, s in samples.items():
        ms = float(np.median(s))
        out["ms_per_step"][name] = ms
        out["mfu"][name] = step_flops() / (ms / 1e3) / (args.peak_tflops * 1e12)
        print(
            f"{name:10s} {ms:8.2f} ms/step  MFU {out['mfu'][name]:.1%}  samples {np.round(s, 2).tolist()}",
            flush=True,
        )
    out["samples_ms"] = samples
    if args.profile:
        # A device trace of 5 steps each, summed by operation (trace_ops.py) into
        # DIR/<name>-ops.json: a flat file, which the device tool brings back.
        from trace_ops import summarize

        for name in ("bundle", *variants, *(k for k in peers if k == "jax_splash512")):
            where = Path(args.profile) / f"{name}-trace"
            jax.profiler.start_trace(str(where))
            time_peer(name, 5) if name in peers else time_bundle(5, variants.get(name))
            jax.profiler.stop_trace()
            rows = summarize(where, top=None)  # every op: the HLO dump says what each is
            (Path(args.profile) / f"{name}-ops.json").write_text(json.dumps(rows, indent=1))
            out[f"{name}_top_ops"] = rows[:10]
            print(f"profile of {name}: {where}; largest: {rows[0]['op']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("-o", "--output", required=True)
    b = sub.add_parser("bench")
    b.add_argument("bundle")
    b.add_argument("--platform", default=None)
    b.add_argument("--precision", default=None)
    b.add_argument("--workdir", default="/tmp/gpt55m")
    b.add_argument("--batches", type=int, default=4)
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--peak-tflops", type=float, default=197.0)
    b.add_argument("--out", default=None)
    b.add_argument("--profile", default=None, help="trace 5 steps of each, write per-op sums here")
    b.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also the bundle with fused_attention.TUNING set to JSON (or @FILE); a key "
        '"onehot" sets stablehlo/onehot.py\'s TUNING instead',
    )
    b.add_argument(
        "--peers", default="bundle_unfused,jax,jax_splash512", help="the hand-written peers to run"
    )
    a = p.parse_args()
    if a.cmd == "export":
        from stepbundle.exporter import export

        report = export(recipe(), a.output)
        print(f"wrote {report.path} ({report.size} bytes, {report.digest})")
        return 0
    return bench(a)


if __name__ == "__main__":
    raise SystemExit(main())
