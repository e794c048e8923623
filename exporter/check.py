"""The torch_xla front-end's references for the export check (``stepbundle.frontend.step_check``).

A torch_xla bundle replays torch_xla's semantics: its random numbers come from XLA's
generator (the seed rule of ``rng_seeds.py``), and with ``numerics="torch_xla"`` its
training BatchNorm is XLA's expansion. PyTorch on the CPU computes neither, so for those
steps the check compares against torch_xla eager from the bundle's seed (the same
masks: torch_xla eager is deterministic across processes, DESIGN.md). Every other step is
compared against PyTorch on the CPU, the ground truth.

One case has no reference: a step that draws random numbers *and* has training
BatchNorm rewritten to PyTorch's numerics (the default): only torch_xla eager draws the
same numbers, and it computes BatchNorm the other way. The check is skipped, saying so.

Imports: torch, torch_xla (through ``xla.py``), stepbundle.frontend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stepbundle.frontend.recipe import Recipe
from stepbundle.frontend.step_check import CPU_EAGER, Bounds, Reference
from stepbundle.schema.version import NUMERICS_TORCH_XLA

from . import xla
from .workspace import move_to_device

__all__ = ["references"]


def _on_cpu(model: torch.nn.Module) -> bool:
    return all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])


def _cpu_step(
    recipe: Recipe,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    seed: int | None,
) -> tuple[Mapping[str, Any], dict[str, torch.Tensor]]:
    if not _on_cpu(model):  # a recipe built on the XLA device: its copy comes back first
        move_to_device(model, opt, torch.device("cpu"))
    return CPU_EAGER.run(recipe, model, opt, batch, seed)


def _xla_step(
    recipe: Recipe,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    seed: int | None,
) -> tuple[Mapping[str, Any], dict[str, torch.Tensor]]:
    from stepbundle.frontend.step_check import state_by_name

    device = xla.device()
    move_to_device(model, opt, device)
    saved = xla.get_rng_state()
    try:
        xla.sync()
        if seed is not None:
            xla.set_rng_state(seed)
        metrics = recipe.step(model, opt, {k: v.to(device) for k, v in batch.items()})
        xla.sync()
        out = {
            k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()
        }
        return out, state_by_name(model, opt, copy=False)
    finally:
        xla.set_rng_state(saved)


CPU = Reference(CPU_EAGER.name, _cpu_step, float64=True)
XLA_EAGER = Reference("torch_xla eager (the bundle's seed)", _xla_step)
# numerics="torch_xla": torch_xla compiles XLA's BatchNorm expansion with its XLA, the
# runtime with jax's, and the cancellation in E[x^2] - E[x]^2 lands differently: a CI
# machine measured torch_xla eager 5% of the parameters' movement away from such a bundle
# (tests/equivalence/equiv_models.py). A quarter of the update bounds that; the value term
# (bfloat16-sized, for the running statistics) is about 3% of a tensor's norm, more than a
# step moves a weight, so an update further than half its size from eager's is suspect and
# PyTorch float64 on the CPU decides (the same BatchNorm in exact arithmetic;
# ``step_compare.update_verdicts``): a dropped update is refused.
_XLA_BOUNDS = Bounds(update=0.25, eps=float(torch.finfo(torch.bfloat16).eps), atol=1e-5,
                     metric=3e-2, suspect=0.5,
                     label="XLA's BatchNorm expansion and bfloat16-sized rounding")  # fmt: skip
XLA_NUMERICS = Reference(
    "torch_xla eager (numerics='torch_xla')",
    _xla_step,
    float64=True,
    float64_run=_cpu_step,
    bounds=_XLA_BOUNDS,
)
# With random numbers only torch_xla eager draws the bundle's: no float64 step decides.
XLA_NUMERICS_RANDOM = Reference(XLA_NUMERICS.name, _xla_step, bounds=_XLA_BOUNDS)


def references(numerics: str, numerics_rewrites: int) -> tuple[Reference, Reference | str]:
    """The check's reference for a step without random numbers, and for one with them
    (or why none reproduces it)."""
    if numerics == NUMERICS_TORCH_XLA:
        return XLA_NUMERICS, XLA_NUMERICS_RANDOM
    if numerics_rewrites:
        return CPU, (
            "the step draws random numbers (dropout, ...) and computes training BatchNorm: "
            "only torch_xla eager draws the bundle's random numbers, and it computes "
            'BatchNorm as XLA does, which numerics="pytorch" replaced; no eager step '
            "computes this bundle's step, so it was written unchecked"
        )
    return CPU, XLA_EAGER
