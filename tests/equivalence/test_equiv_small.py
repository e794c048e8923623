"""Equivalence, small cases: Linear + AdamW (torch's and torch_xla's syncfree), a CNN
with BatchNorm and Dropout under nesterov SGD, an LSTM tagger under Adam.

Each case trains K steps (a) with torch_xla eagerly, (b) from its bundle in a process
without torch, (c) with PyTorch on the CPU, from the same initial state and batches;
see equiv_harness.py for how runs are compared and equiv_models.py for every bound and
its reason.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from equiv_harness import (
    CaseRuns,
    assert_matches_cpu,
    assert_matches_float64,
    assert_replays_torch_xla,
)
from equiv_models import CASES

NAMES = [
    "Linear(5,3) + AdamW",
    "Linear(5,3) + syncfree AdamW",
    "CNN + BatchNorm + Dropout, SGD nesterov",
    "LSTM tagger + embedding, Adam",
]


@pytest.mark.parametrize("name", NAMES)
def test_bundle_replays_torch_xla(name: str, equiv_runs: Callable[[str], CaseRuns]) -> None:
    assert_replays_torch_xla(equiv_runs(name))


@pytest.mark.parametrize("name", NAMES)
def test_bundle_matches_pytorch_cpu(name: str, equiv_runs: Callable[[str], CaseRuns]) -> None:
    assert_matches_cpu(equiv_runs(name))


@pytest.mark.parametrize("name", [n for n in NAMES if CASES[n].float64])
def test_bundle_matches_pytorch_float64(name: str, equiv_runs: Callable[[str], CaseRuns]) -> None:
    assert_matches_float64(equiv_runs(name))


def test_adam_state_is_all_there(equiv_runs: Callable[[str], CaseRuns]) -> None:
    runs = equiv_runs("Linear(5,3) + AdamW")
    steps = CASES["Linear(5,3) + AdamW"].steps
    for p in ("weight", "bias"):
        for key in ("exp_avg", "exp_avg_sq"):
            assert f"optimizer.state.{p}.{key}" in runs.bundle.state
        assert float(runs.bundle.state[f"optimizer.state.{p}.step"]) == steps


def test_syncfree_never_skipped_a_step(equiv_runs: Callable[[str], CaseRuns]) -> None:
    runs = equiv_runs("Linear(5,3) + syncfree AdamW")
    assert np.all(runs.bundle.series("found_inf") == 0)
    assert float(runs.bundle.state["optimizer.state.weight.step"]) == len(runs.bundle.metrics)


def test_batchnorm_statistics_are_state(equiv_runs: Callable[[str], CaseRuns]) -> None:
    runs = equiv_runs("CNN + BatchNorm + Dropout, SGD nesterov")
    steps = CASES["CNN + BatchNorm + Dropout, SGD nesterov"].steps
    for bn in ("features.1", "features.5"):
        assert int(runs.bundle.state[f"{bn}.num_batches_tracked"]) == steps
        # The running statistics moved away from their initial 0 and 1.
        assert np.abs(runs.bundle.state[f"{bn}.running_mean"]).max() > 1e-3
        assert np.abs(runs.bundle.state[f"{bn}.running_var"] - 1).max() > 1e-3
    assert "optimizer.state.fc.weight.momentum_buffer" in runs.bundle.state
