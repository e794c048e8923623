"""The reported case: nn.Linear(5, 3) trained with AdamW on an XLA device.

Export it with ``stepbundle export examples/linear_adamw.py:recipe -o linear.stepbundle``.
"""

from __future__ import annotations

import torch

from stepbundle.exporter import Recipe


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def recipe() -> Recipe:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    # capturable=True keeps AdamW's step count on the device, so the bias correction is
    # computed in the graph; foreach=False because torch_xla has no foreach kernels.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, capturable=True, foreach=False)
    x = torch.randn(8, 5)
    y = x @ torch.randn(5, 3) + 0.1
    return Recipe(model=model, optimizer=optimizer, step=train_step, example_batch={"x": x, "y": y})


def data(steps: int = 8):
    """Batches for ``stepbundle run --data``: the same linear target, fresh inputs."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 3, generator=g)
    xs = torch.randn(steps, 8, 5, generator=g)
    return {"x": xs.numpy(), "y": (xs @ w + 0.1).numpy()}
