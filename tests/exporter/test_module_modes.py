"""The exporter traces each module in the mode the user left it in, and records it.

A fine-tuning recipe keeps BatchNorm frozen (eval mode: running statistics read, never
updated) and a dropout off; the train entry must run them so, as the user's eager loop
does, and the manifest says which modules were in eval mode (``Entry.eval_modules``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import mse_step, regression_batch
from modes_net import ModesNet, prepared
from support import (
    assert_runs_close,
    make_batches,
    run_bundle_inprocess,
    train_eager_cpu,
    train_eager_xla,
)

from stepbundle.cli.main import main
from stepbundle.exporter import Recipe, export
from stepbundle.exporter.modes import eval_batchnorm
from stepbundle.schema import Manifest, open_bundle

SEED = 4321


def _Net() -> ModesNet:
    return ModesNet(torch.relu, dropout2=0.3)


def _eval(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"loss": torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])}


def _recipe(frozen: bool = True) -> Recipe:
    torch.manual_seed(0)
    model = prepared(_Net(), frozen=frozen)
    # SGD, not Adam: fc2's bias feeds a training BatchNorm (bn2) through a ReLU, and in
    # a channel whose pre-activations are all positive its gradient is exactly zero (a
    # BatchNorm's input gradient sums to zero per channel): PyTorch float64 leaves those
    # biases where they are. Any float32 run gets a rounding-noise gradient (1e-9) there,
    # which Adam's update m / sqrt(v) turns into steps of up to lr, a different noise per
    # host's kernels: with AdamW (lr 0.01) the bundle and torch_xla eager each moved
    # those biases by 0.02 and ended 7.7e-4 apart on an AVX2 EPYC (under 1e-5 on an
    # AVX-512 Xeon). SGD moves them by 1e-8, as float64 says.
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return Recipe(
        model=model,
        optimizer=opt,
        step=mse_step,
        example_batch=regression_batch(16),
        eval_step=_eval,
        seed=SEED,
    )


def _eager(recipe_fn: Callable[[], Recipe]) -> Callable[[], Recipe]:
    """The recipe as an eager torch_xla loop must run it: torch_xla 2.9 cannot
    differentiate eval-mode BatchNorm, so the step runs under ``eval_batchnorm()`` (as
    the exporter traces it)."""

    def recipe() -> Recipe:
        r = recipe_fn()
        user_step = r.step

        def step(model, optimizer, batch):
            with eval_batchnorm():
                return user_step(model, optimizer, batch)

        r.step = step
        return r

    return recipe


def _check(recipe_fn: Callable[[], Recipe], tmp_path: Path, steps: int, name: str) -> Manifest:
    """Export, run ``steps`` steps, compare every loss and state with torch_xla eager.

    Exported with torch_xla's BatchNorm numerics (``numerics="torch_xla"``): this compares
    modes, and the default (stable) BatchNorm differs from torch_xla's by rounding.
    tests/exporter/test_numerics.py checks the default. Both runs are float32 over the
    same ops, so they differ by rounding only; 1e-5 leaves room for rounding amplified
    where the problem is ill-conditioned (measured: 2.1e-7 at most, ``_recipe`` says why
    it trains with SGD).
    """
    path = tmp_path / f"{name}.stepbundle"
    export(dataclasses.replace(recipe_fn(), numerics="torch_xla"), path)
    batches = make_batches(recipe_fn(), 3)
    ref = train_eager_xla(_eager(recipe_fn), batches, steps, seed=SEED)
    with open_bundle(path) as b:
        m = b.manifest
    got = run_bundle_inprocess(path, batches, steps, seed=SEED if m.rng else None)
    worst = assert_runs_close(got, ref, rtol=1e-5, what=name)
    print(f"{name} vs torch_xla eager: {worst}")
    return m


_eager_xla_recipe = _eager(_recipe)


def test_torch_xla_cannot_differentiate_eval_batchnorm_by_itself() -> None:
    """Why the exporter computes eval-mode BatchNorm itself (exporter/modes.py). When this
    fails, torch_xla has fixed it: remove the shim."""
    batches = make_batches(_recipe(), 1)
    with pytest.raises(RuntimeError, match="size of offset factor is 0"):
        train_eager_xla(_recipe, batches, 1, seed=SEED)


def test_frozen_batchnorm_and_eval_dropout_match_torch_xla_eager(tmp_path: Path) -> None:
    m = _check(_recipe, tmp_path, 3, "frozen")
    assert m.entries["train"].eval_modules == ("bn1", "drop1")
    # The eval entry ran every module in eval mode, the model itself included.
    assert m.entries["eval"].eval_modules == tuple(n for n, _ in _Net().named_modules())
    # The frozen BatchNorm's statistics are read, not updated: no output writes them,
    # while the training BatchNorm's are.
    updated = {o.state for o in m.entries["train"].programs[0].outputs if hasattr(o, "state")}
    assert "bn1.running_mean" not in updated and "bn1.num_batches_tracked" not in updated
    assert {"bn2.running_mean", "bn2.running_var"} <= updated


def test_the_modes_change_the_training(tmp_path: Path) -> None:
    """The frozen run is not the all-train run: the test above could tell them apart."""
    batches = make_batches(_recipe(), 3)
    frozen = train_eager_xla(_eager_xla_recipe, batches, 2, seed=SEED)
    trained = train_eager_xla(lambda: _recipe(frozen=False), batches, 2, seed=SEED)
    assert abs(frozen.metrics[0]["loss"] - trained.metrics[0]["loss"]) > 1e-3
    np.testing.assert_array_equal(frozen.state["bn1.running_mean"], np.full(16, 0.5, np.float32))
    assert not np.allclose(trained.state["bn1.running_mean"], 0.5)
    # The all-train twin exports and matches its own eager run too.
    path = tmp_path / "trained.stepbundle"
    export(_recipe(frozen=False), path)
    got = run_bundle_inprocess(path, batches, 2, seed=SEED)
    np.testing.assert_allclose(got.series("loss"), trained.series("loss"), rtol=1e-5)


def test_a_frozen_recipe_and_its_all_train_twin_write_different_bundles(tmp_path: Path) -> None:
    a, b = tmp_path / "frozen.stepbundle", tmp_path / "trained.stepbundle"
    export(_recipe(frozen=True), a)
    export(_recipe(frozen=False), b)
    assert a.read_bytes() != b.read_bytes()
    with open_bundle(a) as fa, open_bundle(b) as fb:
        assert fa.manifest.entries["train"].eval_modules == ("bn1", "drop1")
        assert fb.manifest.entries["train"].eval_modules == ()
        # Different programs, not only a different manifest field.
        pa = fa.section(fa.manifest.entries["train"].programs[0].section)
        pb = fb.section(fb.manifest.entries["train"].programs[0].section)
        assert bytes(pa) != bytes(pb)


def _no_dropout(dtype: torch.dtype) -> Callable[[], Recipe]:
    def recipe() -> Recipe:
        r = _recipe()
        r.model.drop2.p = 0.0
        # Both BatchNorms frozen: a training BatchNorm over ReLU features that are nearly
        # always zero divides rounding noise by a near-zero variance (float32 is then
        # 1e-3 from float64), which would hide an error in the frozen one.
        r.model.bn2.eval()
        r.model.to(dtype)
        # SGD: Adam's update divides by sqrt(v) and turns rounding in tiny gradients
        # into relative errors of its own.
        r.optimizer = torch.optim.SGD(r.model.parameters(), lr=0.1, momentum=0.9)

        def step(model, optimizer, batch):
            return mse_step(model, optimizer, {k: v.to(dtype) for k, v in batch.items()})

        r.step = step
        return r

    return recipe


def test_frozen_batchnorm_matches_pytorch_float64(tmp_path: Path) -> None:
    """The eval-mode BatchNorm the exporter computes is BatchNorm: the bundle stays as
    close to PyTorch float64 on the CPU as PyTorch float32 does."""
    path = tmp_path / "f32.stepbundle"
    r = _no_dropout(torch.float32)()
    export(r, path)
    batches = make_batches(r, 3)
    got = run_bundle_inprocess(path, batches, 3)
    f64 = train_eager_cpu(_no_dropout(torch.float64), batches, 3)
    f32 = train_eager_cpu(_no_dropout(torch.float32), batches, 3)
    assert got.series("loss")[0] != got.series("loss")[-1]
    d_bundle = np.max(np.abs(got.series("loss") - f64.series("loss")) / f64.series("loss"))
    d_f32 = np.max(np.abs(f32.series("loss") - f64.series("loss")) / f64.series("loss"))
    print(f"loss vs float64: bundle {d_bundle:.3g}, PyTorch float32 {d_f32:.3g}")
    assert d_bundle <= max(2 * d_f32, 1e-6)  # 6.7e-8 and 1.0e-7 here
    for name in ("fc1.weight", "bn1.weight", "bn2.bias", "out.weight"):
        ref = f64.state[name]
        d = np.max(np.abs(got.state[name] - ref)) / np.max(np.abs(ref))
        d32 = np.max(np.abs(f32.state[name] - ref)) / np.max(np.abs(ref))
        print(f"{name} vs float64: bundle {d:.3g}, PyTorch float32 {d32:.3g}")
        assert d <= max(2 * d32, 1e-6), (name, d, d32)
    np.testing.assert_array_equal(got.state["bn1.running_var"], np.full(16, 2.0, np.float32))


def test_the_users_modes_are_left_as_they_were(tmp_path: Path) -> None:
    r = _recipe()
    before = [m.training for m in r.model.modules()]
    export(r, tmp_path / "x.stepbundle")
    assert [m.training for m in r.model.modules()] == before


def test_a_model_in_eval_mode_trains_in_eval_mode(tmp_path: Path) -> None:
    """A Hugging Face from_pretrained model starts in eval mode: it is traced so (no
    dropout, running statistics read), as the user's eager loop would run it."""

    def recipe() -> Recipe:
        r = _recipe(frozen=False)
        r.model.eval()
        return r

    m = _check(recipe, tmp_path, 2, "all-eval")
    assert m.entries["train"].eval_modules == tuple(n for n, _ in _Net().named_modules())
    assert m.rng is None  # no dropout ran: no seed input


def test_a_step_that_sets_the_modes_itself_is_recorded_as_it_ran(tmp_path: Path) -> None:
    def step(model, optimizer, batch):
        model.train()
        model.bn1.eval()
        return mse_step(model, optimizer, batch)

    def recipe() -> Recipe:
        r = _recipe(frozen=False)
        r.model.eval()  # the step puts it back in train mode, bn1 frozen
        r.step = step
        return r

    m = _check(recipe, tmp_path, 2, "step-sets")
    assert m.entries["train"].eval_modules == ("bn1",)


def test_inspect_shows_the_modules_in_eval_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "frozen.stepbundle"
    export(_recipe(), path)
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  eval mode  bn1, drop1 (2)" in lines
    assert "  eval mode  the model, fc1, bn1, drop1, fc2, bn2, ... (8 modules)" in lines
    assert main(["inspect", "--full", str(path)]) == 0
    full = capsys.readouterr().out.splitlines()
    assert "  modules in eval mode: bn1, drop1 (2)" in full
