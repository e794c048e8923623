"""The torch_xla front-end's own refusal of a scheduler stepped inside the exported step.

Declared, a hyperparameter the step changes itself is refused by name; undeclared, the
changing settings change the graph, and the torch_xla front-end's graph-change message
(exporter/graphdiff.py) names them and the declaration that fixes it. What both
front-ends do with tuple hyperparameters is tests/frontends/test_frontends_tuple_hyperparameters.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from export_helpers import mse_step, regression_batch

from stepbundle.exporter import ExportError, Recipe, export

STEPS = 6


def _recipe(*, hyperparameters: tuple[str, ...]) -> Recipe:
    """Adam under OneCycleLR, stepped inside the step (as an exported step must not)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(
        model.parameters(), lr=1e-3, betas=(0.9, 0.99), capturable=True, foreach=False
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.05, total_steps=STEPS, pct_start=0.5, base_momentum=0.8, max_momentum=0.95
    )

    def step(model, optimizer, batch):
        out = mse_step(model, optimizer, batch)
        sched.step()
        return out

    return Recipe(
        model=model,
        optimizer=opt,
        step=step,
        example_batch=regression_batch(16),
        hyperparameters=hyperparameters,
    )


def test_a_scheduler_stepped_inside_the_step_is_refused(tmp_path: Path) -> None:
    r = _recipe(hyperparameters=("betas.0",))
    with pytest.raises(ExportError, match=r"changed hyperparameter 'betas.0' itself"):
        export(r, tmp_path / "x.stepbundle")
    # Undeclared, the settings change the graph: the refusal names them and the fix.
    with pytest.raises(ExportError) as e:
        export(_recipe(hyperparameters=()), tmp_path / "y.stepbundle")
    msg = str(e.value)
    assert "changed between two consecutive traced steps" in msg
    assert (
        "optimizer settings changed between the steps: param_groups[0]['lr'] from 0.002 to "
        "0.0375001, param_groups[0]['betas'][0] from 0.95 to 0.8375" in msg
    )
    assert "Declare them, Recipe(hyperparameters=('lr', 'betas.0'))" in msg
