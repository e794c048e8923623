"""Recipes the torch front-end's tests share (beside tests/equivalence/equiv_models.py).

Imports torch and the Recipe only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.exporter import Recipe


def mlp_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    optimizer.zero_grad()
    logits = model(batch["x"])
    loss = F.cross_entropy(logits, batch["label"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["label"]).float().mean()}


def mlp_eval(model: nn.Module, batch: dict[str, Any]) -> Any:
    logits = model(batch["x"])
    return {"loss": F.cross_entropy(logits, batch["label"]), "logits": logits}


def mlp(dropout: float = 0.0, batches: tuple[int, ...] = (32,)) -> Recipe:
    """An MLP classifier: Linear (no bias before the BatchNorm, which would subtract it
    right back out), BatchNorm, GELU, dropout, AdamW, clipping, ``lr`` declared, an eval
    entry; one shape bucket per batch size."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(20, 64, bias=False),
        nn.BatchNorm1d(64),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 4),
    )
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-3, weight_decay=0.01, capturable=True, foreach=False
    )
    g = torch.Generator().manual_seed(1)
    examples = [
        {"x": torch.randn(n, 20, generator=g), "label": torch.randint(0, 4, (n,), generator=g)}
        for n in batches
    ]
    return Recipe(
        model=model,
        optimizer=opt,
        step=mlp_step,
        example_batch=examples[0],
        example_batches=examples[1:],
        eval_step=mlp_eval,
        hyperparameters=("lr",),
        seed=2024,
    )


def mlp_no_dropout() -> Recipe:
    return mlp(0.0)


def mlp_dropout() -> Recipe:
    return mlp(0.3)


def mlp_two_buckets() -> Recipe:
    """The MLP with a second shape bucket (a short last batch of 8)."""
    return mlp(0.0, batches=(32, 8))


def mlp_accum_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]
) -> Any:
    """Gradient accumulation: 4 micro-batches, then clipping and one optimizer step."""
    optimizer.zero_grad()
    total = torch.zeros(())
    for x, y in zip(batch["x"].chunk(4), batch["label"].chunk(4)):
        loss = F.cross_entropy(model(x), y) / 4
        loss.backward()
        total = total + loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    return {"loss": total, "grad_norm": norm}


def mlp_bf16_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    """Mixed precision: float32 weights, the forward under bf16 autocast."""
    optimizer.zero_grad()
    with torch.autocast(device_type=batch["x"].device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(batch["x"]), batch["label"])
    loss.backward()
    optimizer.step()
    return {"loss": loss.float()}


def mlp_accum() -> Recipe:
    r = mlp(0.0)
    r.step = mlp_accum_step
    return r


def mlp_bf16() -> Recipe:
    r = mlp(0.0)
    r.step = mlp_bf16_step
    return r


def random_numbers_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]
) -> Any:
    """A step whose metrics are its random numbers (to check the documented seed rule)."""
    optimizer.zero_grad()
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss, "uniform": torch.rand(3), "normal": torch.randn(2)}
