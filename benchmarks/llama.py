"""A Llama-style decoder (RMSNorm, rotary embeddings, grouped-query SDPA, SwiGLU) at the
sizes ``export_scale.py`` exports, and its recipe, built on the meta device or on the CPU.

Sizes (``SIZES``): ``llama117m`` (the issue #40 model: 12 layers, width 768, context 1024,
batch 8), ``llama1b`` (TinyLlama 1.1B's shapes: 22 layers, width 2048, 32 heads, 4 k-v heads,
MLP 5632, vocabulary 32,000, context 2048) and ``llama8b`` (Llama 3 8B's shapes: 32 layers,
width 4096, 32 heads, 8 k-v heads, MLP 14336, vocabulary 128,256), plus ``tiny`` for tests.

``recipe(size, device="meta")`` builds the model as people build big models, under
``torch.device("meta")`` (no memory for weights), then computes the rotary tables, which
are part of the model's code and in no checkpoint, as real CPU tensors: the case
``docs/exporting.md`` ("Models too big to materialize") describes. Such a recipe exports
weights-free only (``include_state=False``).

Imports: torch, stepbundle.frontend (the Recipe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    width: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    context: int
    batch: int
    tied: bool = False
    rope_theta: float = 10000.0
    eps: float = 1e-5
    checkpointed: bool = False  # each layer under torch.utils.checkpoint (recomputed)


SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab=64, width=32, layers=2, heads=4, kv_heads=2, mlp=48, context=16,
                        batch=2),
    "llama117m": LlamaConfig(vocab=32000, width=768, layers=12, heads=12, kv_heads=12, mlp=2304,
                             context=1024, batch=8, tied=True),
    "llama1b": LlamaConfig(vocab=32000, width=2048, layers=22, heads=32, kv_heads=4, mlp=5632,
                           context=2048, batch=4),
    "llama8b": LlamaConfig(vocab=128256, width=4096, layers=32, heads=32, kv_heads=8, mlp=14336,
                           context=2048, batch=1, rope_theta=500000.0),
}  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rotary_tables(
    cfg: LlamaConfig, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [context, head_dim], float32."""
    hd = cfg.width // cfg.heads
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
    )
    t = torch.arange(cfg.context, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        hd = cfg.width // cfg.heads
        self.q = nn.Linear(cfg.width, cfg.heads * hd, bias=False)
        self.k = nn.Linear(cfg.width, cfg.kv_heads * hd, bias=False)
        self.v = nn.Linear(cfg.width, cfg.kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.heads * hd, cfg.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h, kvh = self.heads, self.kv_heads
        hd = c // h
        q = self.q(x).view(b, t, h, hd).transpose(1, 2)
        k = self.k(x).view(b, t, kvh, hd).transpose(1, 2)
        v = self.v(x).view(b, t, kvh, hd).transpose(1, 2)
        # cos/sin in the activation dtype (as Hugging Face's Llama): under autocast q, k
        # and v then share one dtype
        cos, sin = cos[:t].to(q.dtype), sin[:t].to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if kvh != h:  # grouped-query attention: each k-v head serves h // kvh query heads
            k = k[:, :, None].expand(b, kvh, h // kvh, t, hd).reshape(b, h, t, hd)
            v = v[:, :, None].expand(b, kvh, h // kvh, t, hd).reshape(b, h, t, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.width, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.width, cfg.eps)
        self.gate = nn.Linear(cfg.width, cfg.mlp, bias=False)
        self.up = nn.Linear(cfg.width, cfg.mlp, bias=False)
        self.down = nn.Linear(cfg.mlp, cfg.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.width, cfg.eps)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.embed.weight
        cos, sin = rotary_tables(cfg)
        # Non-persistent: part of the model's code, in no checkpoint (the bundle stores them)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            if self.cfg.checkpointed:
                x = checkpoint(layer, x, self.cos, self.sin, use_reentrant=False)
            else:
                x = layer(x, self.cos, self.sin)
        return self.head(self.norm(x))


def parameter_count(cfg: LlamaConfig) -> int:
    """Parameters of the model at ``cfg`` (tied ones once), from shapes alone."""
    with torch.device("meta"):
        model = Llama(cfg)
    return sum(p.numel() for p in model.parameters())


def step(model: Any, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """bf16 autocast, cross-entropy, gradient norm clipped at 1, AdamW."""
    optimizer.zero_grad()
    with torch.autocast(device_type=batch["idx"].device.type, dtype=torch.bfloat16):
        logits = model(batch["idx"])
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch["target"].reshape(-1)
    )
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": loss, "grad_norm": grad_norm}


def recipe(size: str | LlamaConfig, *, device: str = "meta") -> Any:
    """A weights-free recipe of the model at ``size``: built on ``device`` ("meta": no
    weights in memory, rotary tables computed on the CPU after; "cpu": an ordinary model)."""
    from stepbundle.frontend.recipe import Recipe

    cfg = SIZES[size] if isinstance(size, str) else size
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    if device == "meta":
        # The rotary tables are code, not weights: real values, on the CPU
        model.cos, model.sin = rotary_tables(cfg, "cpu")
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, weight_decay=0.1, capturable=True, foreach=False
    )
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.context + 1))
    return Recipe(
        model=model,
        optimizer=opt,
        step=step,
        include_state=False,
        example_batch={"idx": tokens[:, :-1].contiguous(), "target": tokens[:, 1:].contiguous()},
    )
