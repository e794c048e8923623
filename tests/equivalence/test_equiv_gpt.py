"""Equivalence, a small GPT: causal attention, LayerNorm, tied embedding, dropout,
AdamW in two parameter groups under a declared warmup-cosine lr schedule (driven by the
runtime), gradient clipping; and its variants with bf16 autocast and with gradient
accumulation over 4 micro-batches inside one step.

See equiv_harness.py for how runs are compared and equiv_models.py for every bound and
its reason (the bf16 bounds are stated there).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from equiv_harness import CaseRuns, assert_matches_cpu, assert_replays_torch_xla
from equiv_models import CASES, GPT_SCHEDULE, GPT_SCHEDULE_OFFSET

from stepbundle.runtime.train.schedule import parse_schedule

GPT = "GPT (tied emb., dropout, clip, warmup-cosine)"
NAMES = [GPT, "GPT, bf16 autocast", "GPT, 4 accumulated micro-batches"]


@pytest.mark.parametrize("name", NAMES)
def test_bundle_replays_torch_xla(name: str, equiv_runs: Callable[[str], CaseRuns]) -> None:
    assert_replays_torch_xla(equiv_runs(name))


@pytest.mark.parametrize("name", NAMES)
def test_bundle_matches_pytorch_cpu(name: str, equiv_runs: Callable[[str], CaseRuns]) -> None:
    assert_matches_cpu(equiv_runs(name))


def test_tied_embedding_stays_tied(equiv_runs: Callable[[str], CaseRuns]) -> None:
    state = equiv_runs(GPT).bundle.state
    # One tensor under both of PyTorch's names, as in module.state_dict().
    np.testing.assert_array_equal(state["head.weight"], state["tok.weight"])


def test_the_schedule_changes_lr_on_every_step() -> None:
    """The runtime's schedule is what the comparison with torch_xla exercises: torch_xla
    sets group["lr"] itself before every step, so a schedule the runtime ignored, or an
    lr frozen at its export value, diverges at once. That needs an lr that changes on
    every step of the run: warmup, peak, then cosine decay."""
    f = parse_schedule(GPT_SCHEDULE)
    lrs = [f(i + GPT_SCHEDULE_OFFSET) for i in range(CASES[GPT].steps)]
    assert lrs[0] < lrs[1] < lrs[2] and lrs[2] > lrs[3] > lrs[4] > 0
