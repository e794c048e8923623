"""Make ``sdpa_mesh.stepbundle``: a one-block GPT (attention only) whose attention is an SDPA composite in bf16.

Run once with the torch front-end's environment (``.venv-torch/bin/python
tests/runtime/data/make_sdpa_mesh.py``); the bundle is committed, and
``tests/runtime/test_mesh_attention.py`` runs its train program with the fused kernels
(interpreted) on 1, 4 and 8 virtual CPU devices, with no torch in the process.

Only the attention is bf16: q, k and v are cast to it before
``F.scaled_dot_product_attention(is_causal=True)`` and its output back to float32, so
the composite is one the kernels take (``fused_attention.composite_supported``) while
every other product, and so every sum the partitioner splits, stays float32 and the
layouts can be held to the data-parallel bounds. nanoGPT's names (the default
tensor-parallel rules split ``c_attn``, ``c_proj``, ``wte``, ``lm_head``), no MLP, SGD (a
small file); sizes: vocabulary 64, width 128, 2 heads of 64 (the kernels' smallest head
size), context 128 (the kernels' block), batch 8 (two integer inputs, ``idx`` and ``y``:
i64[8, 128]).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.export_torch import Recipe, export

HERE = Path(__file__).resolve().parent
VOCAB, WIDTH, HEADS, T, BATCH = 64, 128, 2, 128, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias on ln_1 nor on c_attn: each shifts the keys, which softmax ignores, so
        # their gradients are sums that cancel to noise (make_tiny_gpt.py). With ln_1's
        # bias, its update after 2 steps differed 3.6e-6 normwise between 1 and 4 devices
        # unfused and 1.9e-5 fused (a float32 ulp of q, k or v flips a bf16 rounding), while
        # every other tensor agreed within 1.5e-7: the bound would judge noise.
        self.ln_1 = nn.LayerNorm(WIDTH, bias=False)
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            a.view(b, t, HEADS, c // HEADS).transpose(1, 2).bfloat16()
            for a in self.c_attn(self.ln_1(x)).split(c, 2)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).to(x.dtype)
        return x + self.c_proj(o.transpose(1, 2).reshape(b, t, c))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(T, WIDTH)
        self.h = Block()
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.h(self.wte(idx) + self.wpe(pos))
        return self.lm_head(self.ln_f(x))


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
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    example = {
        "idx": torch.randint(0, VOCAB, (BATCH, T), generator=g),
        "y": torch.randint(0, VOCAB, (BATCH, T), generator=g),
    }
    export(
        Recipe(model=model, optimizer=opt, step=step, example_batch=example, seed=0),
        HERE / "sdpa_mesh.stepbundle",
    )


if __name__ == "__main__":
    main()
