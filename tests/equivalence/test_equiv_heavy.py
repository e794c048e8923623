"""Equivalence, models nobody here wrote: torchvision's resnet18 (random init, 32x32
inputs; also against PyTorch float64) and a Hugging Face Llama built from a tiny config (random init, nothing
downloaded), trained with the model's own loss. Marked heavy; the default test command
still runs them.

See equiv_harness.py for how runs are compared and equiv_models.py for every bound and
its reason.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from equiv_harness import (
    CaseRuns,
    assert_matches_cpu,
    assert_matches_float64,
    assert_replays_torch_xla,
)

pytestmark = pytest.mark.heavy

NAMES = ["torchvision resnet18", "HF Llama (tiny config), own loss"]


@pytest.mark.parametrize("name", NAMES)
def test_bundle_replays_torch_xla(name: str, equiv_runs: Callable[[str], CaseRuns]) -> None:
    assert_replays_torch_xla(equiv_runs(name))


@pytest.mark.parametrize("name", NAMES)
def test_bundle_matches_pytorch_cpu(name: str, equiv_runs: Callable[[str], CaseRuns]) -> None:
    assert_matches_cpu(equiv_runs(name))


def test_resnet18_matches_pytorch_float64(equiv_runs: Callable[[str], CaseRuns]) -> None:
    """The default export computes BatchNorm as PyTorch does: against float64, the
    ground truth, it is held to the float32 bounds, where torch_xla's own ops are not."""
    assert_matches_float64(equiv_runs("torchvision resnet18"))
