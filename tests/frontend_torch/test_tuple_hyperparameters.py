"""Tuple hyperparameters through the torch front-end: Adam's ``betas.0`` under OneCycleLR.

As with the torch_xla front-end (tests/exporter/test_tuple_hyperparameters.py): declared
``lr`` and ``betas.0`` are inputs the runtime schedules, and the bundle driven by the
values OneCycleLR gives matches PyTorch stepping OneCycleLR itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support import Run, assert_runs_close, make_batches, train_eager_cpu

from stepbundle.export_torch import export
from stepbundle.exporter import ExportError
from stepbundle.frontend.recipe import Recipe
from stepbundle.runtime import load
from stepbundle.schema import InputKind

STEPS = 6


def _one_cycle(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.OneCycleLR:
    return torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.05, total_steps=STEPS, pct_start=0.5, base_momentum=0.8, max_momentum=0.95
    )


def _step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _recipe(*, hyperparameters: tuple[str, ...] = (), eager: bool = False) -> Recipe:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    sched = _one_cycle(opt)
    step = _step
    if eager:  # the user's loop steps the scheduler; the runtime does it for the bundle

        def step(model, optimizer, batch):
            out = _step(model, optimizer, batch)
            sched.step()
            return out

    g = torch.Generator().manual_seed(0)
    return Recipe(
        model=model,
        optimizer=opt,
        step=step,
        example_batch={"x": torch.randn(16, 5, generator=g), "y": torch.randn(16, 3, generator=g)},
        hyperparameters=hyperparameters,
    )


def _one_cycle_values() -> tuple[list[float], list[float]]:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, betas=(0.9, 0.99))
    sched = _one_cycle(opt)
    lrs, beta1s = [], []
    for _ in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        beta1s.append(opt.param_groups[0]["betas"][0])
        opt.step()
        sched.step()
    return lrs, beta1s


def test_one_cycle_momentum_on_betas_0_matches_pytorch_eager(tmp_path: Path) -> None:
    lrs, beta1s = _one_cycle_values()
    assert len(set(beta1s)) >= STEPS - 1
    path = tmp_path / "onecycle.stepbundle"
    report = export(_recipe(hyperparameters=("lr", "betas.0")), path)
    assert report.notes == []
    prog = report.manifest.entries["train"].programs[0]
    assert {i.name for i in prog.inputs if i.kind is InputKind.HYPERPARAMETER} == {"lr", "betas.0"}
    batches = make_batches(_recipe(), 3)
    ref = train_eager_cpu(lambda: _recipe(eager=True), batches, STEPS)
    trainer = load(path, cache_dir=False)
    trainer.set_schedule("lr", lambda i: lrs[i])
    trainer.set_schedule("betas.0", lambda i: beta1s[i])
    ms = trainer.run(list(batches), STEPS)
    got = Run(
        [{k: float(np.asarray(v, np.float64).reshape(-1)[0]) for k, v in m.items()} for m in ms],
        {k: np.asarray(v) for k, v in trainer.state_dict().items()},
    )
    worst = assert_runs_close(got, ref, rtol=1e-5, what="onecycle")
    print(f"OneCycleLR lr + beta1 vs PyTorch eager: {worst}")


def test_the_scheduler_note_and_the_beta2_refusal(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"lr 0.002 and betas \(0.95, 0.99\) were set by a sch"):
        report = export(_recipe(), tmp_path / "note.stepbundle")
    assert report.notes[0].startswith("lr 0.002 and betas (0.95, 0.99) were set by a scheduler")
    with pytest.raises(ExportError, match=r"'betas.1' \(beta2\) cannot be declared for Adam"):
        export(_recipe(hyperparameters=("betas.1",)), "/nonexistent/x.stepbundle")
