"""The exporter does not run the steps it traces (#15): its bundle is the one the old path,
which compiled and ran every traced step as torch_xla eager would, wrote.

The only difference allowed is in the programs' debug locations, which name torch_xla's
HLO instruction numbers (a per-process counter): the programs must print the same
without them, and every other section and the manifest's tables must be equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from export_helpers import mse_step, regression_batch

from stepbundle.exporter import ExportError, Recipe, export
from stepbundle.exporter.export import export_running_traced_steps
from stepbundle.schema import open_bundle
from stepbundle.stablehlo.artifact import parse_artifact


def _bn_adam() -> Recipe:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(), torch.nn.Linear(4, 3)
    )
    return Recipe(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True, foreach=False),
        step=mse_step,
        example_batch=regression_batch(),
    )


def _dropout_sgd_seeded() -> Recipe:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Dropout(0.3), torch.nn.Linear(6, 3))
    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        step=mse_step,
        example_batch=regression_batch(),
        seed=1234,
    )


def _export(recipe: Recipe, path: Path, *, execute: bool) -> Path:
    export_running_traced_steps(recipe, path, run_traced_steps=execute)
    return path


@pytest.mark.parametrize("make", [_bn_adam, _dropout_sgd_seeded], ids=["bn_adam", "dropout_sgd"])
def test_bundle_equals_the_executing_path(make, tmp_path: Path) -> None:
    old = _export(make(), tmp_path / "old.stepbundle", execute=True)
    new = _export(make(), tmp_path / "new.stepbundle", execute=False)
    with open_bundle(old) as a, open_bundle(new) as b:
        ma, mb = a.manifest, b.manifest
        assert ma.entries == mb.entries
        assert ma.state == mb.state
        assert ma.rng == mb.rng
        assert [s.name for s in ma.sections] == [s.name for s in mb.sections]
        programs = {p.section for e in ma.entries.values() for p in e.programs}
        assert programs
        for sec in ma.sections:
            x, y = bytes(a.section(sec.name)), bytes(b.section(sec.name))
            if sec.name in programs:
                assert parse_artifact(x).text() == parse_artifact(y).text(), sec.name
            else:
                assert x == y, sec.name


def _executions() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("ExecuteTime")
    return 0 if data is None else int(data[0])


def test_the_traced_steps_are_not_run(tmp_path: Path) -> None:
    """torch_xla's own count of graph executions: the default export runs exactly two
    fewer graphs (the two traced training steps) than the executing path."""
    counts = {}
    for execute in (True, False):
        before = _executions()
        if execute:
            _export(_bn_adam(), tmp_path / f"{execute}.stepbundle", execute=True)
        else:
            export(_bn_adam(), tmp_path / f"{execute}.stepbundle")  # the default
        counts[execute] = _executions() - before
    assert counts[True] - counts[False] == 2, counts


def _zero_grad_last(model, optimizer, batch):  # nanoGPT's train.py order
    out = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    out.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": out}


def test_gradients_set_to_none_at_the_end_do_not_make_the_export_run_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #40: with zero_grad(set_to_none=True) after optimizer.step(), the first trace
    (with zero gradients) finds the gradients dropped and the export traces again without
    them; the dropped gradients, accumulated into in place, were left pending, so
    ``skip_step`` refused to drop that traced step and it was compiled and run (5x the
    export time of zero_grad() first). Now every traced step is dropped, and the bundle is
    the zero_grad()-first one."""
    from stepbundle.exporter import xla

    kept: list[int] = []
    real = xla.skip_step

    def spy(state):  # the real skip_step, recording how many tensors made it run the step
        pending = real(state)
        kept.append(len(pending))
        return pending

    monkeypatch.setattr(xla, "skip_step", spy)
    bundles = {}
    for name, step in (("first", mse_step), ("last", _zero_grad_last)):
        recipe = _bn_adam()
        recipe.step = step
        kept.clear()
        bundles[name] = export(recipe, tmp_path / f"{name}.stepbundle", check=False)
        assert kept and kept == [0] * len(kept), f"zero_grad {name}: traced steps run: {kept}"
    assert bundles["first"].digest == bundles["last"].digest


def _logging_recipe(log: torch.Tensor) -> Recipe:
    """A step that also writes a device tensor of the user's, outside the model and the
    optimizer, and never reads it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)

    def step(model, optimizer, batch):
        out = mse_step(model, optimizer, batch)
        log.copy_(out["loss"].detach())
        return out

    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        step=step,
        example_batch=regression_batch(),
    )


def test_a_tensor_the_step_writes_outside_the_state_keeps_its_value(tmp_path: Path) -> None:
    """Dropping the traced step would drop every pending value on the device, this
    tensor's too (reading it then aborted the process): the exporter runs the step
    instead, and the user's tensor holds what torch_xla eager would give it."""
    import torch_xla

    device = torch_xla.device()
    expected = torch.zeros((), device=device)
    _export(_logging_recipe(expected), tmp_path / "old.stepbundle", execute=True)
    log = torch.zeros((), device=device)
    before = _executions()
    export(_logging_recipe(log), tmp_path / "new.stepbundle")
    assert _executions() > before  # the traced steps ran
    assert float(log.cpu()) == float(expected.cpu()) != 0.0


def test_a_changing_captured_tensor_is_still_refused_by_name() -> None:
    """A device tensor the step updates and reads again (an EMA in a closure) would be
    frozen into the bundle: refused with the executing path's message, not a crash."""
    import torch_xla

    ema = torch.zeros((), device=torch_xla.device())
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)

    def step(model, optimizer, batch):
        out = mse_step(model, optimizer, batch)
        ema.mul_(0.9).add_(0.1 * out["loss"].detach())
        return {"loss": out["loss"], "ema": ema * 1}

    recipe = Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        step=step,
        example_batch=regression_batch(),
    )
    with pytest.raises(ExportError, match="changed between two consecutive traced steps"):
        export(recipe, Path("/nonexistent/never-written.stepbundle"))
