"""Attention as people write it, through both front-ends, against hand-written JAX, on a TPU.

    # here: weights-free bundles, one per model and front-end (export check off: a benchmark)
    .venv/bin/python benchmarks/device/attention_table.py export -o build/tpu/table --frontend torch_xla
    .venv-torch/bin/python benchmarks/device/attention_table.py export -o build/tpu/table --frontend torch
    # on the device machine (no torch): every bundle of the folder and each model's JAX peer
    python benchmarks/device/attention_table.py bench build/tpu/table --out attention_table.json
    # (or in two calls on the same warm machine, the second adding to the first's file:
    #  --models gpt55m_forward_mask,gpt55m_buffer_mask,gpt55m_sdpa, then the rest with
    #  --append attention_table.json: each family compiles 2-4 bundles and its peer)
    python benchmarks/device/attention_table.py table attention_table.json   # the docs' table

The torch_xla front-end's export of the Llama took 17.2 GB at its peak in the session that
first measured it (240 s), more than a shared machine should give one process; the three
55M GPT forms took at most 6.0 GB (torch_xla) and 1.1 GB (torch) of resident memory here.

Models (issue #38, item 4), each a training step under bf16 autocast with the loss in
float32, the gradient norm clipped to 1 and a capturable AdamW step, no dropout (so the
JAX peer computes the same function):

- ``gpt55m_forward_mask``, ``gpt55m_buffer_mask``, ``gpt55m_sdpa``: gpt.py's 55M GPT
  (6 layers, width 768, 12 heads of 64, context 512, batch 16) with its attention written
  with the causal mask made in ``forward``; as nanoGPT writes it (a ``tril`` held in
  ``register_buffer("bias", ...)``, ``masked_fill(bias[:, :, :t, :t] == 0, -inf)``); and
  as ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``;
- ``llama120m_sdpa``: Hugging Face's ``LlamaForCausalLM`` at 123M parameters (8 layers,
  width 1024, 8 heads of 128, 2 key/value heads, SwiGLU of 2816, vocabulary 16,384,
  untied head, context 1024, batch 8), ``attn_implementation="sdpa"``;
- ``gpt2_sdpa``, ``gpt2_eager``: Hugging Face's ``GPT2LMHeadModel`` at GPT-2 small's
  config (124M, vocabulary 50,257, context 1024, batch 8, dropout 0) with
  ``attn_implementation="sdpa"`` and ``"eager"``.

Each family's JAX peer is the same model written by hand with jax's splash attention
(blocks of 512, as the runtime's fused kernels use), f32 master weights cast to bf16 at each
product, optax AdamW with PyTorch's constants and clipping, one ``jax.jit`` with the state
donated (gpt.py's peer for the GPT). ``bench`` makes one initial state per family
(normal(0, 0.02) weights, unit norm scales, zero biases; a mask buffer its lower
triangle), starts every bundle of the family (``init_from``) and the peer from it, reports
the first losses, then times them in alternating rounds, one family at a time (all of
them at once do not fit in the chip's memory). Per row: ms per step, MFU (6 x matmul
parameters x tokens plus 12 x layers x context x attention width x tokens, causal
masking not discounted, against the v5e's 197 TFLOP/s bf16 peak), the attentions fused
per program and the runtime's words for each one kept.

Imports: numpy; jax and optax for ``bench``; torch, transformers and a front-end for
``export``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import gpt  # noqa: E402  (the 55M GPT's sizes, initial state, FLOP count and JAX peer)


@dataclass(frozen=True)
class Family:
    """One model shape: its sizes, FLOP count and what a step reads."""

    vocab: int
    context: int
    batch: int
    layers: int
    width: int  # the attention's width (heads x head size)
    matmul_params: int  # parameters that take part in a product per token

    def step_flops(self) -> float:
        tokens = self.batch * self.context
        return (
            6.0 * self.matmul_params * tokens
            + 12.0 * self.layers * self.context * self.width * tokens
        )


LLAMA = {
    "vocab": 16384,
    "width": 1024,
    "layers": 8,
    "heads": 8,
    "kv_heads": 2,
    "head_dim": 128,
    "ffn": 2816,
    "context": 1024,
    "batch": 8,
    "rope_theta": 10000.0,
    "eps": 1e-6,
}
GPT2 = {"vocab": 50257, "width": 768, "layers": 12, "heads": 12, "context": 1024, "batch": 8}

FAMILIES: dict[str, Family] = {
    "gpt55m": Family(
        gpt.VOCAB,
        gpt.BLOCK,
        gpt.BATCH,
        gpt.LAYERS,
        gpt.WIDTH,
        gpt.LAYERS * 12 * gpt.WIDTH**2 + gpt.VOCAB * gpt.WIDTH,
    ),
    "llama120m": Family(
        LLAMA["vocab"],
        LLAMA["context"],
        LLAMA["batch"],
        LLAMA["layers"],
        LLAMA["heads"] * LLAMA["head_dim"],
        LLAMA["layers"]
        * (
            2 * LLAMA["width"] * LLAMA["heads"] * LLAMA["head_dim"]
            + 2 * LLAMA["width"] * LLAMA["kv_heads"] * LLAMA["head_dim"]
            + 3 * LLAMA["width"] * LLAMA["ffn"]
        )
        + LLAMA["vocab"] * LLAMA["width"],
    ),
    "gpt2": Family(
        GPT2["vocab"],
        GPT2["context"],
        GPT2["batch"],
        GPT2["layers"],
        GPT2["width"],
        GPT2["layers"] * 12 * GPT2["width"] ** 2 + GPT2["vocab"] * GPT2["width"],
    ),
}

MODELS: dict[str, tuple[str, str]] = {  # model -> (family, attention form)
    "gpt55m_forward_mask": ("gpt55m", "forward_mask"),
    "gpt55m_buffer_mask": ("gpt55m", "buffer_mask"),
    "gpt55m_sdpa": ("gpt55m", "sdpa"),
    "llama120m_sdpa": ("llama120m", "sdpa"),
    "gpt2_sdpa": ("gpt2", "sdpa"),
    "gpt2_eager": ("gpt2", "eager"),
}


# ------------------------------------------------------------------ export (torch)
def _gpt55m(form: str) -> Any:
    import models
    import torch
    import torch.nn.functional as F
    from models import GELU

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.heads
        q, k, v = (
            a.view(b, t, h, c // h).transpose(1, 2) for a in self.qkv(self.ln1(x)).split(c, 2)
        )
        if form == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
            if form == "buffer_mask":  # nanoGPT's model.py
                att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            else:
                mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                att = att.masked_fill(~mask, float("-inf"))
            y = att.softmax(dim=-1) @ v
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)), approximate=GELU)))

    torch.manual_seed(0)
    cfg = models.GPTConfig(
        vocab=gpt.VOCAB, block=gpt.BLOCK, layers=gpt.LAYERS, width=gpt.WIDTH,
        heads=gpt.HEADS, dropout=0.0, batch=gpt.BATCH,
    )  # fmt: skip
    model = models.SmallGPT(cfg)
    for block in model.blocks:
        block.forward = forward.__get__(block)
        if form == "buffer_mask":
            tril = torch.tril(torch.ones(gpt.BLOCK, gpt.BLOCK))
            block.register_buffer("bias", tril.view(1, 1, gpt.BLOCK, gpt.BLOCK))
    return model


def _llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=LLAMA["vocab"],
        hidden_size=LLAMA["width"],
        intermediate_size=LLAMA["ffn"],
        num_hidden_layers=LLAMA["layers"],
        num_attention_heads=LLAMA["heads"],
        num_key_value_heads=LLAMA["kv_heads"],
        head_dim=LLAMA["head_dim"],
        max_position_embeddings=LLAMA["context"],
        rms_norm_eps=LLAMA["eps"],
        rope_theta=LLAMA["rope_theta"],
        tie_word_embeddings=False,
        attention_dropout=0.0,
        use_cache=False,
    )
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def _gpt2(form: str) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_positions=GPT2["context"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel._from_config(cfg, attn_implementation=form)


def build_model(model_name: str) -> Any:
    family, form = MODELS[model_name]
    if family == "gpt55m":
        return _gpt55m(form)
    if family == "llama120m":
        return _llama()
    return _gpt2(form)


def export_all(out: Path, frontend: str, names: list[str]) -> None:
    import torch

    if frontend == "torch_xla":
        from stepbundle.exporter import export
    else:
        from stepbundle.export_torch import export
    from stepbundle.frontend.recipe import Recipe

    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        family = FAMILIES[MODELS[name][0]]
        hf = not name.startswith("gpt55m")

        def step(model: Any, optimizer: Any, batch: dict[str, Any], hf: bool = hf) -> Any:
            optimizer.zero_grad()
            with torch.autocast(device_type=batch["idx"].device.type, dtype=torch.bfloat16):
                logits = model(batch["idx"]).logits if hf else model(batch["idx"])
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), batch["target"].reshape(-1)
            )
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), gpt.CLIP)
            optimizer.step()
            return {"loss": loss, "grad_norm": grad_norm}

        model = build_model(name)
        opt = torch.optim.AdamW(
            model.parameters(), lr=gpt.LR, weight_decay=gpt.WEIGHT_DECAY,
            capturable=True, foreach=False,
        )  # fmt: skip
        tokens = torch.randint(0, family.vocab, (family.batch, family.context + 1))
        recipe = Recipe(
            model=model,
            optimizer=opt,
            step=step,
            include_state=False,
            example_batch={
                "idx": tokens[:, :-1].contiguous(),
                "target": tokens[:, 1:].contiguous(),
            },
        )
        path = out / f"{name}-{frontend}.stepbundle"
        t0 = time.perf_counter()
        report = export(recipe, path, check=False)
        print(f"{path}: {report.size} bytes, {time.perf_counter() - t0:.0f} s", flush=True)
        del model, opt, recipe
        gc.collect()


# ------------------------------------------------------------ initial state
def _normal(name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)


def family_state(bundles: list[Path]) -> dict[str, np.ndarray]:
    """One initial state for every tensor the family's bundles need from a file, by rule:
    a 2-D weight normal(0, 0.02) (seeded by its name), a 1-D weight (a norm's scale) ones,
    a bias zeros, a 4-D buffer (a causal mask) its lower triangle. Tied weights once, under
    the first bundle's name."""
    from stepbundle.runtime.dtypes import NUMPY_DTYPES
    from stepbundle.runtime.load import _open_bundle
    from stepbundle.schema.manifest import SectionKind, StateKind

    out: dict[str, np.ndarray] = {}
    known: set[str] = set()
    for path in bundles:
        bundle = _open_bundle(path, None)
        m = bundle.manifest
        for s in m.state:
            if m.section(s.section).kind is not SectionKind.EXTERNAL:
                continue
            if s.name in known or any(a in known for a in s.aliases):
                continue
            known.update((s.name, *s.aliases))
            shape = tuple(s.spec.shape)
            dtype = np.dtype(NUMPY_DTYPES[s.spec.dtype])
            if s.kind is StateKind.BUFFER and len(shape) == 4:
                v = np.tril(np.ones(shape[-2:], dtype)).reshape(shape)
            elif s.name.endswith("bias"):
                v = np.zeros(shape, dtype)
            elif len(shape) == 1:
                v = np.ones(shape, dtype)
            else:
                v = _normal(s.name, shape).astype(dtype)
            out[s.name] = v
        bundle.close()
    return out


def family_batches(family: Family, n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = rng.integers(0, family.vocab, size=(family.batch, family.context + 1))
        out.append({"idx": t[:, :-1].astype(np.int64), "target": t[:, 1:].astype(np.int64)})
    return out


# ------------------------------------------------------------ the JAX peers
def _splash(q: Any, k: Any, v: Any, scale: float) -> Any:
    """Causal attention by jax's splash kernels, (b, h, t, d) in bf16; k and v of fewer
    heads (grouped queries) repeated first, as the runtime does."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if k.shape[1] != q.shape[1]:
        k = jnp.repeat(k, q.shape[1] // k.shape[1], axis=1)
        v = jnp.repeat(v, q.shape[1] // v.shape[1], axis=1)
    t, blk = q.shape[2], min(512, q.shape[2])
    kernel = sk.make_splash_mha(
        mask=sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(q.shape[1])]),
        block_sizes=sk.BlockSizes(
            block_q=blk,
            block_kv=blk,
            block_q_dkv=blk,
            block_kv_dkv=blk,
            use_fused_bwd_kernel=True,
        ),
        head_shards=1,
        q_seq_shards=1,
    )
    return jax.vmap(kernel)(q * jnp.asarray(scale, q.dtype), k, v)


def _jit_step(loss_fn: Callable[..., Any], params: dict[str, Any]) -> tuple[Any, Any]:
    import jax
    import optax

    tx = optax.chain(
        optax.clip_by_global_norm(gpt.CLIP),
        optax.adamw(gpt.LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=gpt.WEIGHT_DECAY),
    )

    def step(carry: Any, idx: Any, target: Any) -> Any:
        p, o = carry
        loss, g = jax.value_and_grad(loss_fn)(p, idx, target)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss

    return jax.jit(step, donate_argnums=0), (params, tx.init(params))


def _xent(logits: Any, target: Any) -> Any:
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))


def llama_peer(state: dict[str, np.ndarray]) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    bf16, f32 = jnp.bfloat16, jnp.float32
    c = LLAMA
    hd, nh, nkv = c["head_dim"], c["heads"], c["kv_heads"]
    params = {k: jnp.asarray(v) for k, v in state.items()}

    def lin(p: Any, name: str, x: Any) -> Any:
        return jnp.einsum("...i,oi->...o", x.astype(bf16), p[name].astype(bf16))

    def rms(p: Any, name: str, x: Any) -> Any:  # HF's LlamaRMSNorm: float32, scale after
        x = x.astype(f32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + c["eps"])
        return p[name] * x

    def rotate(x: Any, cos: Any, sin: Any) -> Any:
        x1, x2 = jnp.split(x, 2, axis=-1)
        return x * cos + jnp.concatenate([-x2, x1], -1) * sin

    def loss_fn(p: Any, idx: Any, target: Any) -> Any:
        b, t = idx.shape
        inv = 1.0 / (c["rope_theta"] ** (jnp.arange(0, hd, 2, dtype=f32) / hd))
        freqs = jnp.arange(t, dtype=f32)[:, None] * inv[None, :]
        emb = jnp.concatenate([freqs, freqs], -1)
        cos, sin = jnp.cos(emb).astype(bf16), jnp.sin(emb).astype(bf16)
        x = p["model.embed_tokens.weight"][idx]
        for i in range(c["layers"]):
            pre = f"model.layers.{i}."
            h = rms(p, pre + "input_layernorm.weight", x)
            q = lin(p, pre + "self_attn.q_proj.weight", h).reshape(b, t, nh, hd)
            k = lin(p, pre + "self_attn.k_proj.weight", h).reshape(b, t, nkv, hd)
            v = lin(p, pre + "self_attn.v_proj.weight", h).reshape(b, t, nkv, hd)
            q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            y = _splash(q, k, v, 1.0 / math.sqrt(hd)).transpose(0, 2, 1, 3)
            x = x + lin(p, pre + "self_attn.o_proj.weight", y.reshape(b, t, nh * hd)).astype(f32)
            h = rms(p, pre + "post_attention_layernorm.weight", x)
            g = jax.nn.silu(lin(p, pre + "mlp.gate_proj.weight", h))
            u = lin(p, pre + "mlp.up_proj.weight", h)
            x = x + lin(p, pre + "mlp.down_proj.weight", g * u).astype(f32)
        x = rms(p, "model.norm.weight", x)
        return _xent(lin(p, "lm_head.weight", x), target)

    return _jit_step(loss_fn, params)


def gpt2_peer(state: dict[str, np.ndarray]) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    bf16, f32 = jnp.bfloat16, jnp.float32
    c = GPT2
    nh, hd = c["heads"], c["width"] // c["heads"]
    params = {k: jnp.asarray(v) for k, v in state.items()}
    wte = "transformer.wte.weight" if "transformer.wte.weight" in params else "lm_head.weight"

    def conv1d(p: Any, name: str, x: Any) -> Any:  # HF's Conv1D: x @ W + b, W is (in, out)
        y = jnp.einsum("...i,io->...o", x.astype(bf16), p[name + ".weight"].astype(bf16))
        return y + p[name + ".bias"].astype(bf16)

    def ln(p: Any, name: str, x: Any) -> Any:
        x = x.astype(f32)
        m = x.mean(-1, keepdims=True)
        var = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]

    def loss_fn(p: Any, idx: Any, target: Any) -> Any:
        b, t = idx.shape
        x = p[wte][idx] + p["transformer.wpe.weight"][:t]
        for i in range(c["layers"]):
            pre = f"transformer.h.{i}."
            qkv = conv1d(p, pre + "attn.c_attn", ln(p, pre + "ln_1", x))
            q, k, v = (a.reshape(b, t, nh, hd).transpose(0, 2, 1, 3) for a in jnp.split(qkv, 3, -1))
            y = _splash(q, k, v, 1.0 / math.sqrt(hd)).transpose(0, 2, 1, 3)
            x = x + conv1d(p, pre + "attn.c_proj", y.reshape(b, t, c["width"])).astype(f32)
            h = jax.nn.gelu(conv1d(p, pre + "mlp.c_fc", ln(p, pre + "ln_2", x)), approximate=True)
            x = x + conv1d(p, pre + "mlp.c_proj", h).astype(f32)
        h = ln(p, "transformer.ln_f", x).astype(bf16)
        return _xent(jnp.einsum("bti,vi->btv", h, p[wte].astype(bf16)), target)

    return _jit_step(loss_fn, params)


def peer(family: str, state: dict[str, np.ndarray]) -> tuple[Any, Any]:
    if family == "gpt55m":
        return gpt.jax_step({k: v for k, v in state.items() if k in gpt_names()}, "splash", 512)
    if family == "llama120m":
        return llama_peer(state)
    return gpt2_peer(state)


def gpt_names() -> set[str]:
    return set(gpt.initial_state())


# ------------------------------------------------------------------ bench (device)
VARIANTS = {
    "f32-kernels": "attention composites with float32 operands computed in float32 inside "
    "the kernels (fused_attention.FLOAT32_COMPUTE; bf16 is the default)",
    "narrow-gathers": "gathers from widened float values pick from the narrow value and "
    "widen what they picked, after onehot-sums (narrow_gathers.py)",
    "head-barrier": "an optimization barrier on each product summing over a vocabulary "
    "(the output head's input gradient), so XLA fuses nothing after it (stablehlo/head_barriers.py)",
    "head-barrier-operands": "optimization barriers on the operands and result of each "
    "product with a vocabulary-sized dimension (the output head's three), so XLA fuses "
    "nothing into them (stablehlo/head_barriers.py)",
    "head-barrier-hidden": "optimization barriers on the values of each head product that "
    "are not vocabulary-sized (the activations read, the input gradient written), so XLA "
    "fuses neither the residual stream nor the LayerNorm after them (stablehlo/head_barriers.py)",
    "head-barriers-on": "CompileOptions(head_barriers=True): the runtime's barriers "
    "(stablehlo/head_barriers.py's 'hidden') whatever the compiled program",
    "head-barriers-off": "CompileOptions(head_barriers=False): no barriers",
    "bf16-products-off": "CompileOptions(bf16_products=False): the bundle's float32-out bf16 "
    "products compiled as written (stablehlo/bf16_products.py)",
}
"""Experiments ``--extra STEM,fused,PRECISION,VARIANT`` loads a bundle under. Those in
``LOAD_OPTIONS`` are load options (the load's other choices as by default); each of the
others patches the runtime's rewrites for that one load only, without the load's own
choices (no head barriers, no bf16-out products): compare it with a row loaded so
(``bf16-products-off`` with ``head-barriers-off``), not only with the default row."""

LOAD_OPTIONS: dict[str, dict[str, Any]] = {
    "head-barriers-on": {"head_barriers": True},
    "head-barriers-off": {"head_barriers": False},
    "bf16-products-off": {"bf16_products": False},
}
"""The experiments that are load options (the load's other choices as by default)."""


def _insert_rewrite(
    rewrites: Any, after: str, name: str, count: Any, rewrite: Any, tpu_only: bool = False
) -> None:
    """Put the experiment ``name`` into the runtime's rewrite table after ``after``: on a
    copy of the module where ``count`` finds something, ``rewrite`` (its count in the
    load's notes)."""
    from stepbundle.runtime.compile.stage import Stage
    from stepbundle.stablehlo import artifact as mlir

    def apply(stage: Any, ctx: Any) -> Any:
        if (tpu_only and ctx.platform != "tpu") or not count(stage.module):
            return stage
        copy = mlir.Module.parse_text(stage.module, stage.module.text())
        ctx.notes[name.replace("-", "_")] = rewrite(copy)
        return Stage(copy, stage.program)

    at = [n for n, _ in rewrites.REWRITES].index(after) + 1
    rewrites.REWRITES = (*rewrites.REWRITES[:at], (name, apply), *rewrites.REWRITES[at:])


@contextlib.contextmanager
def variant(name: str | None = None) -> Any:
    """Patch the runtime for the experiment ``name`` (``VARIANTS``) while loading."""

    from stepbundle.runtime.compile import fused_attention as fa
    from stepbundle.runtime.compile import rewrites

    saved = (rewrites.REWRITES, fa.FLOAT32_COMPUTE)
    if name == "narrow-gathers":
        from narrow_gathers import count_narrow_gathers, rewrite_narrow_gathers

        _insert_rewrite(rewrites, "onehot-sums", name, count_narrow_gathers, rewrite_narrow_gathers)
    elif name in LOAD_OPTIONS:  # a load option (bench), not a patch
        pass
    elif name is not None and name.startswith("head-barrier"):
        import functools

        from stepbundle.stablehlo.head_barriers import count_head_barriers, rewrite_head_barriers

        mode = "result" if name == "head-barrier" else name.removeprefix("head-barrier-")
        _insert_rewrite(
            rewrites, "fused-attention", name,
            functools.partial(count_head_barriers, mode=mode),
            functools.partial(rewrite_head_barriers, mode=mode),
            tpu_only=True,
        )  # fmt: skip
    elif name == "f32-kernels":
        fa.FLOAT32_COMPUTE = "f32"
    elif name is not None:
        raise SystemExit(f"unknown variant {name!r}; one of {sorted(VARIANTS)}")
    try:
        yield
    finally:
        rewrites.REWRITES, fa.FLOAT32_COMPUTE = saved


def _optimized(trainer: Any, batch: Any) -> dict[str, Any]:
    """libtpu's estimate of the train program as compiled (``torch_frontend_hlo.summarize``)
    and its largest multi-output product fusion: how many results, how many of them the
    most common shape (the residual stream fused into a head product has 12 of 17)."""
    import re

    from torch_frontend_hlo import summarize

    from stepbundle.runtime.compile.head_choice import computations, holds_product

    plan, _ = trainer._dispatcher.pick("train", batch)
    text = "\n".join(m.to_string() for m in plan.executable.hlo_modules())
    widest = (0, 0, "")
    comps = computations(text)
    for line in comps.get("ENTRY", []):
        m = re.match(r"\s*%(\S+) = \((.*?)\) fusion\(.*calls=%([\w.-]+)", line)
        if not m or not holds_product(comps, m.group(3)):
            continue
        shapes = re.findall(r"\w+\[[\d,]*\]", m.group(2))
        same = max(shapes.count(x) for x in set(shapes))
        if len(shapes) > widest[0]:
            widest = (len(shapes), same, m.group(1))
    summary = summarize(text)
    return {
        "estimated_ms": summary["estimated_ms"],
        "widest_product_fusion": {"op": widest[2], "results": widest[0], "same_shape": widest[1]},
    }


def bench(args: argparse.Namespace) -> int:
    import jax
    import jax.profiler

    from stepbundle.runtime import CompileOptions, LoadOptions, StateOptions, load
    from stepbundle.runtime.state.checkpoint import write_safetensors

    platform = args.platform or jax.default_backend()
    dev = jax.devices(platform)[0]
    out: dict[str, Any] = {
        "jax": jax.__version__,
        "device_kind": dev.device_kind,
        "peak_tflops": args.peak_tflops,
        "precision": args.precision,
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": {},
    }
    if args.append:  # a second run on the same machine adds its families to the file
        before = json.loads(Path(args.append).read_text())
        out["rows"] = before["rows"]
        out["families"] = before.get("families", {})
        out["runs"] = [*before.get("runs", [before.get("models")]), args.models]
    out["models"] = args.models
    if args.out:  # what was measured so far survives a later failure or the time limit
        Path(args.out).write_text(json.dumps(out, indent=1))
    wanted = args.models.split(",") if args.models else list(MODELS)
    folder = Path(args.folder)
    for fam_name in dict.fromkeys(MODELS[m][0] for m in wanted):
        family = FAMILIES[fam_name]
        paths = [
            p
            for m in wanted
            if MODELS[m][0] == fam_name
            for p in sorted(folder.glob(f"{m}-*.stepbundle"))
        ]
        state = family_state(paths)
        if fam_name == "gpt55m":  # gpt.py's own initial state for what it names
            state.update(gpt.initial_state())
        init = Path(args.workdir) / f"{fam_name}-init.safetensors"
        init.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(init, state)
        data = family_batches(family, args.batches)
        runs: dict[str, Any] = {}
        loads = [(p, p.name.removesuffix(".stepbundle"), True, args.precision) for p in paths]
        if args.unfused:  # each bundle also with its traced attention (--no-fused-attention)
            loads += [
                (p, p.name.removesuffix(".stepbundle") + "+unfused", False, args.precision)
                for p in paths
            ]
        for spec in args.extra:  # one bundle once more: STEM,fused|unfused,PRECISION[,VARIANT]
            stem, how, precision, *var = spec.split(",")
            for p in paths:
                if p.name == f"{stem}.stepbundle":
                    name = "+".join([stem, how, precision, *var])
                    loads.append((p, name, how == "fused", precision, *var))
        for path, name, fused, precision, *var in loads:
            row: dict[str, Any] = {"family": fam_name, "bundle": path.name}
            if var:
                row["variant"] = var[0]
            with warnings.catch_warnings(record=True) as caught, variant(*var):
                warnings.simplefilter("always")
                t0 = time.perf_counter()
                try:
                    trainer = load(
                        path,
                        device=platform,
                        options=LoadOptions(
                            compile=CompileOptions(
                                cache_dir=False,
                                matmul_precision=precision,
                                fused_attention=fused,
                                # an experiment alone, not the load's choices on top
                                **LOAD_OPTIONS.get(
                                    var[0] if var else "",
                                    {"head_barriers": False, "bf16_products": False} if var else {},
                                ),
                            ),
                            state=StateOptions(init_from=init, init_strict=False),
                        ),
                    )
                    row["load_s"] = time.perf_counter() - t0
                    info = trainer.load_info
                    row["compile_s"] = info.seconds.get("compile")
                    row["fused_attention"] = info.fused_attention
                    row["head_barriers"] = info.head_barriers
                    row["attention_kept"] = {
                        k: list(v) for k, v in (getattr(info, "attention_kept", {}) or {}).items()
                    }
                    if platform == "tpu":
                        row.update(_optimized(trainer, data[0]))
                    row["first_loss"] = float(trainer.step(data[0])["loss"])
                    runs[name] = ("bundle", trainer)
                except Exception as e:  # recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            row["warnings"] = [
                str(w.message)[:400] for w in caught if "attention" in str(w.message)
            ]
            out["rows"][name] = row
            print(f"{name}: {json.dumps(row)[:600]}", flush=True)
        pname = f"{fam_name}-jax_splash"
        prow: dict[str, Any] = {"family": fam_name, "peer": "jax, splash attention"}
        try:
            if args.no_peer:
                raise RuntimeError("not run (--no-peer)")
            t0 = time.perf_counter()
            f, carry = peer(fam_name, state)
            dev32 = [
                {k: jax.device_put(v.astype(np.int32), dev) for k, v in b.items()} for b in data
            ]
            carry = jax.device_put(carry, dev)
            carry, loss = f(carry, dev32[0]["idx"], dev32[0]["target"])
            prow["first_loss"] = float(loss)
            prow["compile_s"] = time.perf_counter() - t0
            runs[pname] = ("peer", [f, carry, dev32])
        except Exception as e:  # recorded, not fatal
            prow["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        out["rows"][pname] = prow
        print(f"{pname}: {json.dumps(prow)[:600]}", flush=True)

        last_loss: dict[str, float] = {}  # every row takes the same steps on the same batches

        def time_run(
            name: str, n: int, runs: Any = runs, data: Any = data, last_loss: Any = last_loss
        ) -> float:
            kind, obj = runs[name]
            t0 = time.perf_counter()
            if kind == "bundle":
                m = None
                for i in range(n):
                    m = obj.step(data[i % len(data)])
                last_loss[name] = float(m["loss"])  # type: ignore[index]
            else:
                f, carry, dev32 = obj
                for i in range(n):
                    b = dev32[i % len(dev32)]
                    carry, loss = f(carry, b["idx"], b["target"])
                last_loss[name] = float(loss)
                obj[1] = carry
            return (time.perf_counter() - t0) / n * 1e3

        for name in runs:
            time_run(name, 3)
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name in runs:
                samples[name].append(time_run(name, args.steps))
        for name, s in samples.items():
            ms = float(np.median(s))
            mfu = family.step_flops() / (ms / 1e3) / (args.peak_tflops * 1e12)
            out["rows"][name].update(
                ms_per_step=ms, mfu=mfu, samples_ms=s, last_loss=last_loss.get(name)
            )
            fused = sum((out["rows"][name].get("fused_attention") or {}).values())
            print(f"{name:36s} {ms:8.2f} ms/step  MFU {mfu:.1%}  fused {fused}", flush=True)
        if args.profile:
            # A device trace of 5 steps of each, summed by operation (trace_ops.py) into
            # DIR/<name>-ops.json; XLA_FLAGS=--xla_dump_to says what each fusion holds.
            from trace_ops import summarize

            for name in runs:
                where = Path(args.profile) / f"{name}-trace"
                jax.profiler.start_trace(str(where))
                time_run(name, 5)
                jax.profiler.stop_trace()
                rows = summarize(where, top=None)
                (Path(args.profile) / f"{name}-ops.json").write_text(json.dumps(rows, indent=1))
                device = [r for r in rows if r["line"] == "XLA Ops"]
                out["rows"][name]["device_ms_per_step"] = sum(r["total_ms"] for r in device) / 5
                print(
                    f"profile of {name}: {out['rows'][name]['device_ms_per_step']:.2f} ms/step on the device",
                    flush=True,
                )
        out.setdefault("families", {})[fam_name] = {
            "step_tflop": family.step_flops() / 1e12,
            "params": int(sum(v.size for v in state.values() if v.ndim < 4)),
        }
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        runs.clear()
        gc.collect()
    return 0


# ------------------------------------------------------------------ the docs' table
FAMILY_LABELS = {"gpt55m": "55M GPT", "llama120m": "123M Llama", "gpt2": "GPT-2 small"}
LABELS = {
    "gpt55m_forward_mask": "55M GPT, mask made in `forward`",
    "gpt55m_buffer_mask": "55M GPT, mask in a buffer (nanoGPT)",
    "gpt55m_sdpa": "55M GPT, SDPA `is_causal=True`",
    "llama120m_sdpa": "123M Llama (HF, head 128, 2 k-v heads), SDPA",
    "gpt2_sdpa": 'GPT-2 small (HF), `attn_implementation="sdpa"`',
    "gpt2_eager": 'GPT-2 small (HF), `attn_implementation="eager"`',
}


def table(results: dict[str, Any]) -> str:
    """The markdown table docs/tpu.md shows, made from a results file of ``bench``: per
    model and front-end, the attentions fused, ms per step, MFU and the ratio to the
    family's JAX peer (below 1: faster than the peer), and why attention was kept."""
    rows = results["rows"]
    lines = [
        "| model | front-end | fused | ms/step | MFU | vs JAX + splash | attention kept |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, label in LABELS.items():
        family = MODELS[model][0]
        peer = rows.get(f"{family}-jax_splash", {})
        for frontend in ("torch_xla", "torch"):
            row = rows.get(f"{model}-{frontend}")
            if row is None:
                continue
            if "ms_per_step" not in row:
                why = row.get("error", "not run")
                lines.append(f"| {label} | {frontend} | - | - | - | - | {why[:120]} |")
                continue
            fused = sum((row.get("fused_attention") or {}).values())
            ratio = (
                f"{row['ms_per_step'] / peer['ms_per_step']:.2f}x" if "ms_per_step" in peer else "-"
            )
            kept = "; ".join(w for ws in row.get("attention_kept", {}).values() for w in ws)
            kept = kept or "; ".join(row.get("warnings", []))
            lines.append(
                f"| {label} | {frontend} | {fused} | {row['ms_per_step']:.2f} | "
                f"{row['mfu']:.1%} | {ratio} | {kept[:160]} |"
            )
        last = [m for m in LABELS if MODELS[m][0] == family][-1]
        if model == last and "ms_per_step" in peer:  # once per family, after its models
            lines.append(
                f"| {FAMILY_LABELS[family]}: the JAX peer, splash attention | - | - | "
                f"{peer['ms_per_step']:.2f} | {peer['mfu']:.1%} | 1.00x | |"
            )
    return "\n".join(lines) + "\n"


def profile_summary(folder: Path, top: int = 12) -> dict[str, Any]:
    """``bench --profile``'s per-operation sums (``NAME-ops.json``), made small enough to
    keep: per row, the device time per step, the ``top`` operations by time and the
    ``top`` result types by time summed over operations (the ops files hold 5 steps)."""
    import re
    from collections import Counter

    def result(hlo: str | None) -> str:
        if not hlo or " = " not in hlo:
            return "?"
        rest = re.sub(r"/\*index=\d+\*/", "", re.sub(r"\{[^{}]*\}", "", hlo.split(" = ", 1)[1]))
        kind = re.match(r"(.*?) ([\w\-]+)\(", rest)
        if kind:
            return f"{kind.group(2)} {kind.group(1)}"
        # the trace cuts an operation's text at 300 characters: a long tuple of results
        # loses its kind, and is kept as far as it goes
        return rest

    out: dict[str, Any] = {}
    for path in sorted(folder.glob("*-ops.json")):
        ops = [r for r in json.loads(path.read_text()) if r["line"] == "XLA Ops"]
        by_type: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for r in ops:
            by_type[result(r["hlo"])] += r["total_ms"] / 5
            count[result(r["hlo"])] += r["count"] / 5
        ops.sort(key=lambda r: -r["total_ms"])
        out[path.name.removesuffix("-ops.json")] = {
            "device_ms_per_step": round(sum(r["total_ms"] for r in ops) / 5, 2),
            "top_ops": [
                {
                    "op": r["op"],
                    "ms_per_step": round(r["total_ms"] / 5, 3),
                    "result": result(r["hlo"])[:300],
                }
                for r in ops[:top]
            ],
            "top_results": [
                {"result": k[:300], "ops_per_step": round(count[k]), "ms_per_step": round(v, 3)}
                for k, v in by_type.most_common(top)
            ],
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("-o", "--output", required=True, help="a folder")
    e.add_argument("--frontend", choices=("torch_xla", "torch"), required=True)
    e.add_argument("--models", default=",".join(MODELS), help="a comma-separated subset")
    b = sub.add_parser("bench")
    b.add_argument("folder")
    b.add_argument("--models", default=None, help="a comma-separated subset")
    b.add_argument("--platform", default=None)
    b.add_argument("--precision", default="default")
    b.add_argument("--workdir", default="/tmp/attention_table")
    b.add_argument("--batches", type=int, default=4)
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--peak-tflops", type=float, default=197.0)
    b.add_argument("--out", default=None)
    b.add_argument("--unfused", action="store_true", help="also each bundle unfused")
    b.add_argument("--no-peer", action="store_true", help="time the bundles alone")
    b.add_argument(
        "--append", default=None, metavar="JSON", help="start from an earlier run's results"
    )
    b.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="STEM,fused|unfused,PRECISION[,VARIANT]",
        help="also the bundle STEM.stepbundle loaded so (VARIANT: one of VARIANTS)",
    )
    b.add_argument("--profile", default=None, help="trace 5 steps of each, per-op sums here")
    t = sub.add_parser("table", help="print the docs' markdown table of a results file")
    t.add_argument("results")
    s = sub.add_parser("profiles", help="summarize bench --profile's per-op files")
    s.add_argument("folder")
    s.add_argument("--out", required=True)
    a = p.parse_args()
    if a.cmd == "profiles":
        Path(a.out).write_text(json.dumps(profile_summary(Path(a.folder)), indent=1) + "\n")
        return 0
    if a.cmd == "table":
        print(table(json.loads(Path(a.results).read_text())), end="")
        return 0
    if a.cmd == "export":
        export_all(Path(a.output), a.frontend, a.models.split(","))
        return 0
    return bench(a)


if __name__ == "__main__":
    raise SystemExit(main())
