"""The case that started the project: nn.Linear(5, 3) + AdamW, exported and replayed.

(a) torch_xla eagerly, (b) the bundle in a separate process where importing torch
fails. Losses and every final parameter and optimizer-state tensor agree to 1e-5
relative, the loss moves, and a second fresh runtime process reproduces the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import linear_adamw  # noqa: E402
from support import (  # noqa: E402
    assert_runs_close,
    export_recipe,
    make_batches,
    python_has_no_torch,
    run_bundle_lean,
    train_eager_xla,
)

STEPS = 5


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reported") / "linear.stepbundle"
    export_recipe(linear_adamw.recipe, path)
    return path


def test_lean_python_has_no_torch(lean_python: str) -> None:
    assert python_has_no_torch(lean_python)


def test_bundle_replays_torch_xla_eager(bundle: Path, lean_python: str, tmp_path: Path) -> None:
    batches = make_batches(linear_adamw.recipe(), 3)
    ref = train_eager_xla(linear_adamw.recipe, batches, STEPS)
    got = run_bundle_lean(lean_python, bundle, batches, STEPS, tmp_path)
    assert_runs_close(got, ref, rtol=1e-5, what="Linear(5,3)+AdamW")
    # Every parameter and every optimizer-state tensor was compared above; make sure
    # that is what the state holds, and that training actually moved.
    names = set(got.state)
    assert {"weight", "bias"} <= names
    assert {
        f"optimizer.state.{p}.{k}"
        for p in ("weight", "bias")
        for k in ("step", "exp_avg", "exp_avg_sq")
    } <= names
    losses = got.series("loss")
    assert losses[-1] != losses[0]
    assert float(got.state["optimizer.state.weight.step"]) == STEPS
    # The initial weights changed: the parameters are written back every step.
    init = linear_adamw.recipe().model.weight.detach().numpy()
    assert np.max(np.abs(got.state["weight"] - init)) > 1e-3


def test_fresh_process_reproduces_the_run(bundle: Path, lean_python: str, tmp_path: Path) -> None:
    batches = make_batches(linear_adamw.recipe(), 3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = run_bundle_lean(lean_python, bundle, batches, STEPS, tmp_path / "a")
    second = run_bundle_lean(lean_python, bundle, batches, STEPS, tmp_path / "b")
    np.testing.assert_array_equal(first.series("loss"), second.series("loss"))
    for k, v in first.state.items():
        np.testing.assert_array_equal(second.state[k], v, err_msg=k)
