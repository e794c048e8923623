"""Regression tests for what the equivalence suite found, and the upstream behaviours
its bounds rest on.

Fixed in stepbundle:
- trace.py: state an optimizer keeps on the host (a non-capturable Adam's step count)
  crashed the tracer with "Expected XLA tensor"; it is now refused with the message
  that names capturable=True.
- workspace.py: two param groups with the same declared lr shared one device buffer
  (torch_xla hands out one buffer for equal scalars uploaded from the host), so the
  graph had one lr input, bound to one group, and the export was refused.
- trace.py: for the same reason, two 0-dim batch inputs with equal example values were
  one graph input bound to one name; the bundle silently used that input's value for
  both at run time. Each batch tensor now gets its own buffer before tracing.

Pinned upstream behaviours (if one of these starts failing, revisit the bound or the
workaround that cites it):
- torch 2.9's capturable Adam writes NaN at lr = 0 where a second moment is 0; the
  bundle reproduces it exactly (why the GPT cases start one step into the warmup).
- torch_xla updates BatchNorm's running_var with the biased batch variance: the
  default numerics ("pytorch") rewrite that update to PyTorch's unbiased one
  (stablehlo/batch_norm.py), so the CPU comparison holds running_var to the common
  1e-4; numerics="torch_xla" keeps the biased update and replays torch_xla eager.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import run_bundle_inprocess, to_numpy, train_eager_xla

from stepbundle.exporter import ExportError, Recipe, export
from stepbundle.runtime import CompileOptions, LoadOptions
from stepbundle.schema.manifest import InputKind


def _mse(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def _mse_step(model: Any, optimizer: Any, batch: dict[str, torch.Tensor]) -> Any:
    optimizer.zero_grad()
    loss = _mse(model, batch)
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _two_layer(make_opt: Any, *, x: torch.Tensor | None = None, **kw: Any) -> Recipe:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x = torch.randn(8, 4) if x is None else x
    batch = {"x": x, "y": torch.randn(8, 2)}
    return Recipe(model=model, optimizer=make_opt(model), step=_mse_step, example_batch=batch, **kw)


# ------------------------------------------------------------------ fixed here


class _UsersAdamW(torch.optim.AdamW):
    """A user's subclass: torch's own non-capturable AdamW is traced with capturable=True
    (#39 item 4), a subclass keeps the user's setting and so its host step count."""


def test_host_step_count_is_refused_not_crashed() -> None:
    """trace.py: a non-capturable AdamW keeps `step` on the CPU; the tracer read a
    torch_xla id from it and crashed. Now the changing bias correction is refused."""
    r = _two_layer(lambda m: _UsersAdamW(m.parameters(), lr=0.01, foreach=False))
    with pytest.raises(ExportError, match=r"capturable=True \(foreach either way\)"):
        export(r, "/nonexistent/never-written.stepbundle")


def _groups_same_lr(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "weight_decay": 0.1},
            {"params": model[2].parameters(), "weight_decay": 0.0},
        ],
        lr=0.01,
        capturable=True,
        foreach=False,
    )


def test_equal_lrs_in_two_groups_are_two_inputs(tmp_path: Path) -> None:
    """workspace.py: the declared lr of each group is its own graph input, even when the
    values are equal, and the runtime drives each group separately, as torch does."""

    def recipe() -> Recipe:
        return _two_layer(_groups_same_lr, hyperparameters=("lr",))

    path = tmp_path / "groups.stepbundle"
    report = export(recipe(), path)
    prog = report.manifest.entries["train"].programs[0]
    hyper_inputs = sorted(i.name for i in prog.inputs if i.kind is InputKind.HYPERPARAMETER)
    assert hyper_inputs == ["param_groups.0.lr", "param_groups.1.lr"]

    # Different lrs per group from the runtime, against torch_xla with the same lrs.
    lrs = {"param_groups.0.lr": 0.02, "param_groups.1.lr": 0.005}
    from stepbundle.runtime import load

    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    for name, v in lrs.items():
        trainer.set_hyperparameter(name, v)
    batch = {k: to_numpy(v) for k, v in recipe().example_batch.items()}
    steps = 3
    losses = [float(np.asarray(m["loss"])) for m in trainer.run([batch], steps)]
    state = trainer.state_dict()

    def recipe_with_lrs() -> Recipe:
        r = recipe()
        r.optimizer.param_groups[0]["lr"] = lrs["param_groups.0.lr"]
        r.optimizer.param_groups[1]["lr"] = lrs["param_groups.1.lr"]
        return r

    ref = train_eager_xla(recipe_with_lrs, [batch], steps)
    np.testing.assert_allclose(losses, ref.series("loss"), rtol=1e-5)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        np.testing.assert_allclose(state[name], ref.state[name], rtol=1e-5, atol=1e-7)


def test_equal_scalar_batch_inputs_are_two_inputs(tmp_path: Path) -> None:
    """trace.py: 0-dim batch inputs with equal example values are bound separately, in
    the training step and in read-only entries."""

    def step(model: Any, optimizer: Any, batch: dict[str, torch.Tensor]) -> Any:
        optimizer.zero_grad()
        loss = batch["scale"] * _mse(model, batch) + batch["shift"]
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    def evaluate(model: Any, batch: dict[str, torch.Tensor]) -> Any:
        return {"loss": batch["scale"] * _mse(model, batch) + batch["shift"]}

    def recipe() -> Recipe:
        r = _two_layer(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        r.step, r.eval_step = step, evaluate
        r.example_batch = {
            **r.example_batch,
            "scale": torch.tensor(2.0),
            "shift": torch.tensor(2.0),
        }
        return r

    path = tmp_path / "scalars.stepbundle"
    report = export(recipe(), path)
    prog = report.manifest.entries["train"].programs[0]
    assert {"scale", "shift"} <= {i.name for i in prog.inputs if i.kind is InputKind.BATCH}

    batch = {k: to_numpy(v) for k, v in recipe().example_batch.items()}
    batch["scale"], batch["shift"] = np.float32(1.0), np.float32(0.0)
    from stepbundle.runtime import load

    evaluated = float(
        np.asarray(
            load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False))).evaluate(
                batch
            )["loss"]
        )
    )
    got = run_bundle_inprocess(path, [batch], 2)
    ref = train_eager_xla(recipe, [batch], 2)
    np.testing.assert_allclose(got.series("loss"), ref.series("loss"), rtol=1e-5)
    np.testing.assert_allclose(evaluated, ref.series("loss")[0], rtol=1e-5)


# ------------------------------------------------------- pinned upstream behaviour


def test_zero_lr_capturable_adam_nan_is_replayed_exactly(tmp_path: Path) -> None:
    """torch 2.9's capturable Adam computes its denominator as sqrt(v) / (c * -lr) + ...:
    at lr = 0 an element with v = 0 (its gradient was exactly 0) becomes 0 / -0.0 = NaN
    (pytorch/pytorch#126514). The bundle reproduces torch_xla, NaN for NaN; the GPT
    cases therefore start their warmup one step in, where lr > 0."""
    x = torch.randn(8, 4)
    x[:, 0] = 0.0  # the first layer's weight column 0 gets an exactly zero gradient

    def recipe() -> Recipe:
        return _two_layer(
            lambda m: torch.optim.Adam(m.parameters(), lr=0.0, capturable=True, foreach=False),
            x=x,
        )

    path = tmp_path / "zero-lr.stepbundle"
    export(recipe(), path)
    batches = [{k: to_numpy(v) for k, v in recipe().example_batch.items()}]
    ref = train_eager_xla(recipe, batches, 1)
    got = run_bundle_inprocess(path, batches, 1)
    nan_ref = np.isnan(ref.state["0.weight"])
    assert nan_ref[:, 0].all() and not nan_ref[:, 1:].any()  # the hazard is torch's
    np.testing.assert_array_equal(np.isnan(got.state["0.weight"]), nan_ref)
    np.testing.assert_array_equal(got.state["0.weight"][:, 1:], ref.state["0.weight"][:, 1:])


def test_torch_xla_running_var_uses_the_biased_variance() -> None:
    """torch_xla 2.9 updates BatchNorm's running_var with the biased batch variance;
    PyTorch uses the unbiased one. Why the default numerics rewrite the update (and
    numerics="torch_xla" keeps it, to replay torch_xla eager)."""
    import torch_xla

    torch.manual_seed(0)
    x = torch.randn(4, 3, 2, 2) * 2
    n = x.numel() // x.shape[1]
    cpu = torch.nn.BatchNorm2d(3)
    cpu(x)
    xla = torch.nn.BatchNorm2d(3).to(torch_xla.device())
    xla(x.to(torch_xla.device()))
    torch_xla.sync()
    biased = 0.9 + 0.1 * x.var(dim=(0, 2, 3), unbiased=False)
    unbiased = 0.9 + 0.1 * x.var(dim=(0, 2, 3), unbiased=True)
    torch.testing.assert_close(cpu.running_var, unbiased)
    torch.testing.assert_close(xla.running_var.cpu(), biased)
    # The two differ by n / (n - 1) on the batch term.
    assert n == 16
