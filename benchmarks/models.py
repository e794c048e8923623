"""The benchmark's PyTorch models, their training step, and the recipes that export them.

- ``mlp(depth)``: an MLP of ``depth`` x (Linear(16, 16), LayerNorm(16), GELU),
  trained on batches of 32 with MSE and AdamW.
- ``SmallGPT``: a small decoder-only transformer written here: token and position
  embeddings, pre-LayerNorm blocks with causal self-attention and a GELU MLP, dropout,
  and an output head tied to the token embedding. Trained with next-token
  cross-entropy and AdamW.

GELU is PyTorch's default, exact (erf) GELU everywhere; ``GELU = "tanh"`` switches every
method, jax included, to the tanh approximation.

Imports: torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

GELU = "none"  # nn.GELU's ``approximate``: "none" (exact, erf) or "tanh"
MLP_WIDTH = 16
MLP_BATCH = 32
LR = 1e-3
WEIGHT_DECAY = 0.01


def mlp(depth: int, gelu: str = GELU) -> nn.Sequential:
    """``depth`` x (Linear(16, 16), LayerNorm(16), GELU)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [
            nn.Linear(MLP_WIDTH, MLP_WIDTH),
            nn.LayerNorm(MLP_WIDTH),
            nn.GELU(approximate=gelu),
        ]
    return nn.Sequential(*layers)


def wide_mlp(width: int, depth: int) -> nn.Sequential:
    """A few wide Linear layers: a model whose state is large and whose graph is small."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(approximate=GELU)]
    return nn.Sequential(*layers)


def mse_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The ordinary imperative step: zero_grad, forward, MSE loss, backward, step."""
    optimizer.zero_grad()
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    block: int = 32
    layers: int = 4
    width: int = 64
    heads: int = 4
    dropout: float = 0.1
    batch: int = 8


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)), approximate=GELU)))


class SmallGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.block, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    optimizer.zero_grad()
    logits = model(batch["idx"])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["target"].reshape(-1))
    loss.backward()
    optimizer.step()
    return {"loss": loss}


# ------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    """One benchmark case: a model family at one depth."""

    name: str  # "mlp" or "gpt"
    depth: int
    gpt: GPTConfig | None = None

    @property
    def label(self) -> str:
        return f"{self.name}-{self.depth}"


def build_model(case: Case, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if case.name == "mlp":
        return mlp(case.depth)
    assert case.gpt is not None
    return SmallGPT(case.gpt)


def step_fn(case: Case):  # type: ignore[no-untyped-def]
    return mse_step if case.name == "mlp" else gpt_step


def adamw(model: nn.Module, *, for_export: bool) -> torch.optim.AdamW:
    """AdamW as each method wants it: capturable, non-foreach for torch_xla and export."""
    if for_export:
        return torch.optim.AdamW(
            model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, capturable=True, foreach=False
        )
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def make_batches(case: Case, n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """``n`` host batches (numpy) for ``case``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if case.name == "mlp":
            out.append(
                {
                    "x": rng.standard_normal((MLP_BATCH, MLP_WIDTH)).astype(np.float32),
                    "y": rng.standard_normal((MLP_BATCH, MLP_WIDTH)).astype(np.float32),
                }
            )
        else:
            assert case.gpt is not None
            g = case.gpt
            tokens = rng.integers(0, g.vocab, size=(g.batch, g.block + 1))
            out.append(
                {
                    "idx": tokens[:, :-1].astype(np.int64),
                    "target": tokens[:, 1:].astype(np.int64),
                }
            )
    return out


def recipe(case: Case, batch: dict[str, np.ndarray]):  # type: ignore[no-untyped-def]
    """The stepbundle recipe for ``case``, exported from a fresh model."""
    from stepbundle.exporter import Recipe

    model = build_model(case)
    opt = adamw(model, for_export=True)
    example = {k: torch.from_numpy(v.copy()) for k, v in batch.items()}
    return Recipe(model=model, optimizer=opt, step=step_fn(case), example_batch=example, seed=0)
