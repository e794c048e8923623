"""Tuple hyperparameters (Adam's ``betas.0``) and what a scheduler set at construction,
for both front-ends.

OneCycleLR with ``cycle_momentum`` cycles Adam's beta1 along with lr. Declared as
``Recipe(hyperparameters=("lr", "betas.0"))``, both become inputs the runtime schedules,
and a bundle driven by the values OneCycleLR gives matches the front-end's eager run
(torch_xla eager, or PyTorch on the CPU) stepping OneCycleLR itself. Undeclared, the
values a scheduler set when it was created are frozen into the bundle, and the export
says so. (tests/exporter/test_tuple_hyperparameters.py keeps the torch_xla front-end's
own refusal of a scheduler stepped inside the step.)
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import Run, assert_runs_close, make_batches, mse_step

from stepbundle.frontend import ExportError, Recipe
from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.schema import InputKind

STEPS = 6


def _batch(n: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, 5, generator=g), "y": torch.randn(n, 3, generator=g)}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _one_cycle(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.OneCycleLR:
    return torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.05, total_steps=STEPS, pct_start=0.5, base_momentum=0.8, max_momentum=0.95
    )


def _recipe(adam: dict[str, Any], *, hyperparameters: tuple[str, ...], eager: bool = False):
    """Adam under OneCycleLR. ``eager``: the step also steps the scheduler, as the
    user's own loop does (an exported step must not: the runtime sets the values)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99), **adam)
    sched = _one_cycle(opt)
    step = mse_step
    if eager:

        def step(model, optimizer, batch):
            out = mse_step(model, optimizer, batch)
            sched.step()
            return out

    return Recipe(
        model=model, optimizer=opt, step=step, example_batch=_batch(),
        hyperparameters=hyperparameters,
    )  # fmt: skip


def _one_cycle_values() -> tuple[list[float], list[float]]:
    """lr and beta1 OneCycleLR gives each step, read from a scheduler of its own."""
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, betas=(0.9, 0.99))
    sched = _one_cycle(opt)
    lrs, beta1s = [], []
    for _ in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        beta1s.append(opt.param_groups[0]["betas"][0])
        opt.step()
        sched.step()
    return lrs, beta1s


def test_one_cycle_momentum_on_betas_0_matches_eager(frontend, tmp_path: Path) -> None:
    lrs, beta1s = _one_cycle_values()
    assert len(set(beta1s)) >= STEPS - 1 and min(beta1s) < 0.85 < 0.9 < max(beta1s)
    path = tmp_path / "onecycle.stepbundle"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything a scheduler set is declared: no note
        report = frontend.export(_recipe(frontend.adam, hyperparameters=("lr", "betas.0")), path)
    assert report.notes == []
    m = report.manifest
    prog = m.entries["train"].programs[0]
    assert {i.name for i in prog.inputs if i.kind is InputKind.HYPERPARAMETER} == {"lr", "betas.0"}
    # The initial values are the ones OneCycleLR set at construction.
    initial = {h.name: h.value for h in m.hyperparameters}
    assert initial["lr"] == pytest.approx(0.002, rel=1e-6)
    assert initial["betas.0"] == pytest.approx(0.95, rel=1e-6)

    batches = make_batches(_recipe(frontend.adam, hyperparameters=()), 3)
    ref = frontend.eager(
        lambda: _recipe(frontend.adam, hyperparameters=(), eager=True), batches, STEPS
    )
    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    trainer.set_schedule("lr", lambda i: lrs[i])
    trainer.set_schedule("betas.0", lambda i: beta1s[i])
    ms = trainer.run(list(batches), STEPS)
    got = Run(
        [{k: float(np.asarray(v, np.float64).reshape(-1)[0]) for k, v in x.items()} for x in ms],
        {k: np.asarray(v) for k, v in trainer.state_dict().items()},
    )
    worst = assert_runs_close(got, ref, rtol=1e-5, what="onecycle")
    print(f"OneCycleLR lr + beta1 vs {frontend.name} eager: {worst}")

    # The test could fail: with beta1 left at its first value the run is another one.
    fixed = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    fixed.set_schedule("lr", lambda i: lrs[i])
    other = fixed.run(list(batches), STEPS)
    assert abs(float(np.asarray(other[-1]["loss"])) - ref.metrics[-1]["loss"]) > 1e-4


def test_a_short_name_schedules_betas_0_of_every_group(frontend, tmp_path: Path) -> None:
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": params[:2]}, {"params": params[2:], "betas": (0.8, 0.99)}],
        lr=0.01,
        **frontend.adam,
    )
    path = tmp_path / "groups.stepbundle"
    r = Recipe(model=model, optimizer=opt, step=mse_step, example_batch=_batch())
    r.hyperparameters = ("betas.0",)
    m = frontend.export(r, path).manifest
    assert {h.name: round(h.value, 6) for h in m.hyperparameters} == {
        "param_groups.0.betas.0": 0.9,
        "param_groups.1.betas.0": 0.8,
    }
    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    trainer.set_hyperparameter("betas.0", 0.5)
    assert trainer.hyperparameters == {
        "param_groups.0.betas.0": 0.5,
        "param_groups.1.betas.0": 0.5,
    }


def test_beta2_and_whole_tuples_are_refused_with_the_fix(frontend, tmp_path: Path) -> None:
    def export(hyperparameters: tuple[str, ...], name: str) -> None:
        recipe = _recipe(frontend.adam, hyperparameters=hyperparameters)
        frontend.export(recipe, tmp_path / name)

    with pytest.raises(ExportError, match=r"'betas.1' \(beta2\) cannot be declared for Adam"):
        export(("betas.1",), "a.stepbundle")
    with pytest.raises(ExportError, match=r"Declare a tuple's elements one by one: 'betas.0'"):
        export(("betas",), "b.stepbundle")
    with pytest.raises(ExportError, match=r"has 2 elements \(declare betas.0, betas.1\)"):
        export(("betas.2",), "c.stepbundle")


def test_values_a_scheduler_set_are_reported(frontend, tmp_path: Path) -> None:
    with pytest.warns(UserWarning) as caught:
        report = frontend.export(_recipe(frontend.adam, hyperparameters=()), tmp_path / "a.sb")
    expected = (
        "lr 0.002 and betas (0.95, 0.99) were set by a scheduler; declare them to schedule "
        "them at run time (Recipe(hyperparameters=('lr', 'betas.0')), then "
        "trainer.set_schedule or stepbundle run --lr-schedule NAME=SPEC). As exported, the "
        "bundle keeps them fixed at these values."
    )
    assert report.notes == [expected]
    assert expected in [str(w.message) for w in caught]

    # Declaring lr leaves beta1 to report.
    with pytest.warns(UserWarning, match="betas"):
        report = frontend.export(
            _recipe(frontend.adam, hyperparameters=("lr",)), tmp_path / "b.stepbundle"
        )
    assert report.notes[0].startswith("betas (0.95, 0.99) was set by a scheduler; declare it")

    # A scheduler that changes lr at construction (LinearLR's start_factor).
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
    r = Recipe(model=model, optimizer=opt, step=mse_step, example_batch=_batch())
    lines: list[str] = []
    with pytest.warns(UserWarning, match="lr 0.025 was set by a scheduler"):
        report = frontend.export(r, tmp_path / "c.stepbundle", progress=lines.append)
    assert report.notes[0].startswith("lr 0.025 was set by a scheduler; declare it to schedule")
    assert f"note: {report.notes[0]}" in lines

    # One that does not (StepLR) is not reported.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    r = Recipe(model=model, optimizer=opt, step=mse_step, example_batch=_batch())
    assert frontend.export(r, tmp_path / "d.stepbundle").notes == []
