"""Make ``slow_step.stepbundle``: a bundle whose step is slow on a CPU and whose files are
small, for the attacks that need the device to be slower than the host
(``round_four.py``: a signal with a sparse ``--log-every``).

Run once with the exporter's environment (``.venv/bin/python
scripts/attacks/data/make_slow_step.py``); the bundle and its batches
(``slow_step.inputs.npz``) are committed. The model is one Linear(256, 256) applied 40
times with tanh between (66 KB of weights, about 4 GFLOP a step at batch 256), SGD.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.exporter import Recipe, export

HERE = Path(__file__).resolve().parent
WIDTH, DEPTH, BATCH, BATCHES = 256, 40, 256, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(DEPTH):
            x = torch.tanh(self.lin(x))
        return x


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> dict:
    optimizer.zero_grad()
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCHES, BATCH, WIDTH)).astype(np.float32)
    y = np.tanh(rng.standard_normal((BATCHES, BATCH, WIDTH))).astype(np.float32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    example = {"x": torch.from_numpy(x[0]), "y": torch.from_numpy(y[0])}
    export(
        Recipe(model=model, optimizer=opt, step=step, example_batch=example, seed=0),
        HERE / "slow_step.stepbundle",
    )
    np.savez(HERE / "slow_step.inputs.npz", x=x, y=y)


if __name__ == "__main__":
    main()
