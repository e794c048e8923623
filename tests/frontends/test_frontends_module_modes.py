"""Both front-ends trace each module in the mode the user left it in, record it, and
leave the user's modes as they were.

A fine-tuning recipe keeps a BatchNorm frozen (eval mode: running statistics read, never
updated) and a dropout off; the train entry runs them so and ``Entry.eval_modules`` says
which modules were in eval mode. Whether the training then matches each front-end's
eager run is tests/exporter/test_module_modes.py (torch_xla eager) and
tests/frontend_torch/test_module_modes.py (PyTorch).
"""

from __future__ import annotations

from pathlib import Path

import torch
from modes_net import ModesNet, modes_batch, mse_eval, mse_step, prepared

from stepbundle.frontend import Recipe
from stepbundle.schema import StateUpdateOutput

ALL = tuple(n for n, _ in ModesNet().named_modules())


def _recipe(frontend, *, frozen: bool) -> Recipe:
    torch.manual_seed(0)
    model = prepared(ModesNet(), frozen=frozen)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, **frontend.adam)
    return Recipe(model, opt, mse_step, modes_batch(), eval_step=mse_eval)


def test_the_modes_are_recorded_and_left_as_they_were(frontend, tmp_path: Path) -> None:
    r = _recipe(frontend, frozen=True)
    before = [m.training for m in r.model.modules()]
    m = frontend.export(r, tmp_path / "frozen.stepbundle").manifest
    assert [mod.training for mod in r.model.modules()] == before
    assert m.entries["train"].eval_modules == ("bn1", "drop1")
    # The eval entry ran every module in eval mode, the model itself included.
    assert m.entries["eval"].eval_modules == ALL
    # The frozen BatchNorm's statistics are read, not updated; the training one's are.
    outputs = m.entries["train"].programs[0].outputs
    updated = {o.state for o in outputs if isinstance(o, StateUpdateOutput)}
    assert "bn1.running_mean" not in updated and "bn1.num_batches_tracked" not in updated
    assert {"bn2.running_mean", "bn2.running_var"} <= updated
    assert m.rng is None  # the only dropout is off: no seed input

    twin = frontend.export(_recipe(frontend, frozen=False), tmp_path / "trained.stepbundle")
    assert twin.manifest.entries["train"].eval_modules == ()
    assert twin.manifest.rng is not None  # drop1 trains: the program takes a seed


def test_a_model_in_eval_mode_trains_in_eval_mode(frontend, tmp_path: Path) -> None:
    """A Hugging Face from_pretrained model starts in eval mode: it is traced so."""
    r = _recipe(frontend, frozen=False)
    r.model.eval()
    m = frontend.export(r, tmp_path / "all-eval.stepbundle").manifest
    assert m.entries["train"].eval_modules == ALL
    assert m.rng is None  # no dropout ran: no seed input
