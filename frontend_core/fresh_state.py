"""The state a fresh Adam, AdamW or SGD creates on its first step, made before the trace.

A bundle replays the steady-state step, so the state a fresh optimizer creates lazily
on its first step is made first, exactly as torch would make it; both front-ends use
these rules (the torch_xla front-end places ``step`` on the device when the optimizer
keeps it there).

Imports: torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import ExportError

__all__ = ["adam_first_state", "sgd_first_state"]


def adam_first_state(
    group: Mapping[str, Any], p: torch.Tensor, step: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Adam's and AdamW's state before their first step: ``step`` as given, zero moments
    (and a zero ``max_exp_avg_sq`` with amsgrad)."""
    s = {
        "step": step,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group["amsgrad"]:
        s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return s


def sgd_first_state(
    opt: torch.optim.Optimizer, group: Mapping[str, Any], p: torch.Tensor
) -> dict[str, torch.Tensor]:
    """SGD's state before its first step: a zero momentum buffer, or nothing without
    momentum.

    A zero buffer gives exactly the first step's ``clone(grad)`` when dampening is 0
    (``momentum * 0 + grad``).

    Raises:
      ExportError: momentum with dampening, whose first step no steady-state step replays.
    """
    if group["momentum"] == 0:
        return {}
    if group["dampening"] != 0:
        raise ExportError(
            f"{type(opt).__name__} with momentum={group['momentum']} and "
            f"dampening={group['dampening']} starts its momentum buffer from the first "
            "gradient, which no steady-state step can replay. Take one optimizer step "
            "before exporting, or use dampening=0."
        )
    return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
