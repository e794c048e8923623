"""Make ``tiny_gpt.stepbundle``: a two-block GPT with nanoGPT's parameter names, AdamW.

Run once with the torch front-end's environment (``.venv-torch/bin/python
tests/runtime/data/make_tiny_gpt.py``); the bundle is committed, and
``tests/runtime/test_layouts.py`` runs it in every parallel layout (data parallel, ZeRO-1,
FSDP, tensor parallel) against its own one-device run, with no torch in the process.

The names (``transformer.wte.weight``, ``transformer.h.0.attn.c_attn.weight``, ...) are
what the default tensor-parallel rules know (``runtime/placement/layout_spec.py``). Sizes are
small but every matmul weight divides by 2, 4 and 8: vocabulary 32, width 16, 4 heads,
MLP 64, context 8, batch 8 (two integer inputs, ``idx`` and ``y``: i64[8, 8]).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.export_torch import Recipe, export

HERE = Path(__file__).resolve().parent
VOCAB, WIDTH, HEADS, T, BATCH, LAYERS = 32, 16, 4, 8, 8, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias: its key third gets a zero gradient (softmax ignores a shift of the keys),
        # which Adam turns into noise-sized updates that no two sum orders agree on.
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            a.view(b, t, HEADS, c // HEADS).transpose(1, 2) for a in self.c_attn(x).split(c, 2)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "wpe": nn.Embedding(T, WIDTH),
                "h": nn.ModuleList(Block() for _ in range(LAYERS)),
                "ln_f": nn.LayerNorm(WIDTH),
            }
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer["wte"](idx) + self.transformer["wpe"](pos)
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> dict:
    optimizer.zero_grad()
    logits = model(batch["idx"])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def main() -> None:
    torch.manual_seed(0)
    model = GPT()
    # lr 1e-3: at 1e-2 an Adam update of a near-cancelling gradient (a c_proj weight whose
    # exp_avg_sq is 1.7e-9) differed by 1.2e-5 normwise already between 1 and 4 devices of
    # plain data parallelism, as much as the bound; the summation order is all that differs.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(0)
    example = {
        "idx": torch.randint(0, VOCAB, (BATCH, T), generator=g),
        "y": torch.randint(0, VOCAB, (BATCH, T), generator=g),
    }
    export(
        Recipe(model=model, optimizer=opt, step=step, example_batch=example, seed=0),
        HERE / "tiny_gpt.stepbundle",
    )


if __name__ == "__main__":
    main()
