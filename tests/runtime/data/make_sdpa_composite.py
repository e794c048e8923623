"""Make ``sdpa_composite.stepbundle``: a bundle whose programs hold attention composites.

Run once with the torch front-end's environment (``.venv-torch/bin/python
tests/runtime/data/make_sdpa_composite.py``); the bundle and its expected numbers are
committed, and ``tests/runtime/test_attention_composite.py`` runs them on every jax the
runtime supports (0.7.1 and the newest), where nothing knows the composite's name: the
runtime runs its decomposition.

The model: one causal self-attention layer through ``F.scaled_dot_product_attention``
(float32, no autocast) between an embedding and a linear head, SGD. The expected numbers
are PyTorch's, in float64, on the same batches from the same initial state:
``sdpa_composite.expected.npz`` holds the batches (``idx``, ``y``, one row per step), the
per-step losses and the final parameters.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.export_torch import Recipe, export

HERE = Path(__file__).resolve().parent
VOCAB, WIDTH, HEADS, T, BATCH, STEPS, LR = 16, 32, 2, 8, 2, 3, 0.5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, c = x.shape
        q, k, v = (a.view(b, t, HEADS, c // HEADS).transpose(1, 2) for a in self.qkv(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(b, t, c))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> dict:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["idx"]).reshape(-1, VOCAB), batch["y"].reshape(-1))
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    rng = np.random.default_rng(0)
    idx, y = (rng.integers(0, VOCAB, (STEPS, BATCH, T)).astype(np.int64) for _ in range(2))
    example = {"idx": torch.from_numpy(idx[0]), "y": torch.from_numpy(y[0])}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    export(
        Recipe(model=model, optimizer=opt, step=step, example_batch=example, seed=0),
        HERE / "sdpa_composite.stepbundle",
    )
    model64 = model.double()
    opt64 = torch.optim.SGD(model64.parameters(), lr=LR)
    losses = []
    for i in range(STEPS):
        batch = {"idx": torch.from_numpy(idx[i]), "y": torch.from_numpy(y[i])}
        losses.append(float(step(model64, opt64, batch)["loss"].detach()))
    params = {f"param.{k}": v.detach().numpy() for k, v in model64.named_parameters()}
    np.savez(HERE / "sdpa_composite.expected.npz", idx=idx, y=y, losses=np.array(losses), **params)


if __name__ == "__main__":
    main()
