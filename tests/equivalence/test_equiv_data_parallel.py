"""Data parallelism on real models: one export, run on 1 and on 2 or 4 virtual CPU devices.

The GPT is the single-device equivalence case's: its bundle (b) and its torch_xla eager
run (a), made once per session (``equiv_runs``), are not made again here; the CNN's
bucket recipe is exported here (no equivalence case has a second bucket). Bounds are
those of the single-device comparisons in fp32: 1e-5 relative for every metric at every step, and 1e-5 normwise
relative for every state tensor at the end (Adam's second moment 2e-5). The only
difference from one device is the order in which partial sums from different devices
are added; measured on the GPT: metrics 1.2e-7, state 1.2e-6 normwise (1.6e-5 for the
worst single element, an Adam update of a near-zero gradient). The GPT case also holds
the 4-device run to torch_xla eager directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from equiv_harness import CaseRuns, normwise_rel
from equiv_models import (
    CNN_BATCH,
    GPT_SCHEDULE,
    _cnn,
    gpt_dropout,
)
from support import (
    Run,
    assert_runs_close,
    export_recipe,
    make_batches,
)

from stepbundle.exporter import Recipe
from stepbundle.runtime import BindingError, CompileOptions, LoadOptions, ParallelOptions, load
from stepbundle.runtime.train.schedule import parse_schedule

TOL = 1e-5


def _assert_close(got: Run, ref: Run, what: str) -> None:
    assert_runs_close(got, ref, rtol=TOL, state=False, what=what)
    for k, v in ref.state.items():
        if k in got.state or not k.endswith(".grad"):
            bound = 2 * TOL if k.endswith("exp_avg_sq") else TOL
            d = normwise_rel(got.state[k], v)
            assert d <= bound, f"{what}: state {k} differs by {d:.3g} normwise (> {bound})"


def _run(path: Path, batches: list[dict[str, np.ndarray]], steps: int, **kw: Any) -> Run:
    seed = kw.pop("seed", None)
    schedule = kw.pop("schedule", None)
    trainer = load(path, options=LoadOptions.from_keywords(cache_dir=False, **kw))
    if seed is not None:
        trainer.seed = seed
    if schedule is not None:
        trainer.set_schedule("lr", parse_schedule(schedule))
    ms = trainer.run(batches, steps)
    metrics = [{k: float(np.asarray(v).reshape(-1)[0]) for k, v in m.items()} for m in ms]
    return Run(metrics, trainer.state_dict())


GPT_CASE = "GPT (tied emb., dropout, clip, warmup-cosine)"


def test_gpt_on_four_devices_matches_one_device_and_torch_xla(
    equiv_runs: Callable[[str], CaseRuns],
) -> None:
    runs = equiv_runs(GPT_CASE)
    assert runs.case.recipe is gpt_dropout and runs.case.seed == 4321 and runs.case.steps == 5
    assert (runs.case.schedule, runs.case.schedule_offset) == (GPT_SCHEDULE, 0)
    assert runs.bundle_path is not None
    path = runs.bundle_path  # gpt_dropout's bundle, as (b) ran it
    batches = make_batches(gpt_dropout(), runs.case.n_batches)  # the batches (a) and (b) took
    kw = {"seed": 4321, "schedule": GPT_SCHEDULE}
    one = _run(path, batches, 5, **kw)
    four = _run(path, batches, 5, devices=4, **kw)
    _assert_close(four, one, "GPT, 4 devices vs 1")
    # Dropout masks, tied embeddings, clipping (a global norm over sharded gradients)
    # and the schedule all carry over: the 4-device run replays torch_xla eager.
    xla = runs.xla  # train_eager_xla(gpt_dropout, batches, 5, seed=4321, the schedule)
    _assert_close(four, xla, "GPT, 4 devices vs torch_xla eager")
    assert four.metrics[0]["loss"] != four.metrics[-1]["loss"]


def _cnn_buckets() -> Recipe:
    """CNN + BatchNorm + dropout with a second, short-batch bucket of 3 images."""
    r = _cnn(True)
    g = torch.Generator().manual_seed(5)
    short = {"x": torch.randn(3, 3, 12, 12, generator=g), "y": torch.arange(3) % 5}
    return dataclasses.replace(r, example_batches=(short,))


def test_batchnorm_statistics_are_global_and_odd_buckets_are_refused(tmp_path: Path) -> None:
    """BatchNorm's batch statistics are taken over the global batch (the partitioner
    reduces them across devices), so running stats match one device's."""
    path = tmp_path / "cnn.stepbundle"
    export_recipe(_cnn_buckets, path)
    batches = make_batches(_cnn(True), 3)
    assert batches[0]["x"].shape[0] == CNN_BATCH
    one = _run(path, batches, 4, seed=1234)
    two = _run(path, batches, 4, devices=2, seed=1234)
    _assert_close(two, one, "CNN, 2 devices vs 1")
    assert any("running_mean" in k for k in two.state)
    # The 3-image bucket cannot split over 2 devices: refused before dispatch, with the
    # bucket that can be used.
    trainer = load(
        path,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=False), parallel=ParallelOptions(devices=2)
        ),
    )
    g = np.random.default_rng(0)
    short = {
        "x": g.standard_normal((3, 3, 12, 12)).astype(np.float32),
        "y": np.arange(3, dtype=np.int64) % 5,
    }
    with pytest.raises(BindingError) as err:
        trainer.step(short)
    msg = str(err.value)
    assert "has 3 rows" in msg and "2 devices" in msg and "x: f32[6,3,12,12]" in msg
    assert trainer.step_count == 0
    trainer.step(batches[0])  # the state is intact and the full bucket runs
    assert trainer.step_count == 1
    # On one device the same bundle runs both buckets.
    single = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    single.step(short)
    assert single.step_count == 1
