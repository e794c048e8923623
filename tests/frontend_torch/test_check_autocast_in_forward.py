"""The export check finds bf16 autocast wherever the user entered it: around the model in
the step, or inside the model's own forward (a new user's model: the check had looked
for it only when the top module's forward began, judged the bundle by float32's bounds,
and refused a faithful bundle as "a bug of stepbundle", 123x the bound: one element of
an Adam update whose gradient bf16 rounding decides the sign of)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.export_torch import export
from stepbundle.frontend import Recipe


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = (
            nn.LayerNorm(width),
            nn.Linear(width, 2 * width),
            nn.Linear(2 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class InsideForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(*(Residual(16) for _ in range(3)))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return self.out(self.blocks(self.inp(x))).float()


def _step(model: Any, opt: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    opt.zero_grad()
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    return {"loss": loss}


def test_autocast_entered_inside_forward_is_judged_as_autocast(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = InsideForward()
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(16, 8, generator=g), "y": torch.randn(16, 4, generator=g)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    recipe = Recipe(model=model, optimizer=opt, step=_step, example_batch=batch)
    report = export(recipe, tmp_path / "m.stepbundle", check=True)
    assert report.check is not None and report.check.ran and not report.check.reason
