"""The model both front-ends' module-mode tests train: two BatchNorms and dropouts, the
first pair frozen (eval mode) by ``freeze``, as a fine-tuning recipe keeps them.

tests/frontends/test_module_modes.py checks what both front-ends record of the modes;
tests/exporter/ and tests/frontend_torch/test_module_modes.py compare the training with
each front-end's own eager run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from support import mse_step as mse_step  # the step the modes recipes train with


class ModesNet(torch.nn.Module):
    """fc1, bn1, drop1, fc2, bn2, [drop2,] out; ``act`` between the linear layers."""

    def __init__(
        self,
        act: Callable[[torch.Tensor], torch.Tensor] = torch.tanh,
        dropout2: float | None = None,
    ) -> None:
        super().__init__()
        self.act = act
        self.fc1 = torch.nn.Linear(5, 16)
        self.bn1 = torch.nn.BatchNorm1d(16)
        self.drop1 = torch.nn.Dropout(0.5)
        self.fc2 = torch.nn.Linear(16, 16)
        self.bn2 = torch.nn.BatchNorm1d(16)
        self.drop2 = torch.nn.Dropout(dropout2) if dropout2 is not None else torch.nn.Identity()
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop1(self.bn1(self.act(self.fc1(x))))
        return self.out(self.drop2(self.bn2(self.act(self.fc2(h)))))


def prepared(model: ModesNet, *, frozen: bool) -> ModesNet:
    """``model`` with bn1's running statistics far from any batch's (so that reading them,
    eval mode, and computing the batch's own, train mode, differ clearly), and with
    ``frozen`` bn1 and drop1 in eval mode."""
    with torch.no_grad():
        model.bn1.running_mean.fill_(0.5)
        model.bn1.running_var.fill_(2.0)
    if frozen:
        model.bn1.eval()  # frozen BatchNorm: running statistics read, not updated
        model.drop1.eval()  # a dropout the user turned off
    return model


def mse_eval(model, batch):
    return {"loss": torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])}


def modes_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(16, 5, generator=g), "y": torch.randn(16, 3, generator=g)}
