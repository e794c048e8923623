"""The golden bundles of every format version load and reproduce torch_xla eager's numbers.

Each format version has its own folder (tests/golden/v<major>.<minor>), written once by
tests/golden/make_golden.py and never regenerated; every folder is tested here, so a
reader that stops reading an old version's bundles, or reads them wrong, fails. A change
that breaks these is a format break: it needs a new major version.
"""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import (
    GOLDEN_SCHEDULES,
    GOLDEN_STEPS,
    golden_batches,
    golden_bundle,
    golden_expected,
    golden_folder_name,
    golden_names,
    golden_versions,
    rel,
)

from stepbundle.runtime import load
from stepbundle.runtime.train.schedule import parse_schedule
from stepbundle.schema import open_bundle

EVERY_GOLDEN = [
    pytest.param(version, name, id=f"{golden_folder_name(version)}-{name}")
    for version in golden_versions()
    for name in golden_names(version)
]


def test_every_version_folder_has_golden_bundles() -> None:
    assert golden_versions()[0] == (1, 0)
    for version in golden_versions():
        assert golden_names(version), golden_folder_name(version)


@pytest.mark.parametrize(("version", "name"), EVERY_GOLDEN)
def test_golden_bundle_verifies(version: tuple[int, int], name: str) -> None:
    with open_bundle(golden_bundle(name, version)) as b:
        assert b.verify() == []
        assert b.version == version  # each folder holds its own version's bundles
        assert "train" in b.manifest.entries


@pytest.mark.parametrize(("version", "name"), EVERY_GOLDEN)
def test_golden_bundle_reproduces_eager_training(version: tuple[int, int], name: str) -> None:
    trainer = load(golden_bundle(name, version))
    if name in GOLDEN_SCHEDULES:
        trainer.set_schedule("lr", parse_schedule(GOLDEN_SCHEDULES[name]))
    expected = golden_expected(name, version)
    metrics = trainer.run(golden_batches(name, version), GOLDEN_STEPS[name])
    names = sorted(k[len("metric/") :] for k in expected if k.startswith("metric/"))
    assert sorted(metrics[0]) == names
    for k in names:
        got = np.array([float(m[k]) for m in metrics])
        assert rel(got, expected[f"metric/{k}"]) <= 1e-5, (k, got, expected[f"metric/{k}"])
    state = trainer.state_dict()
    want = {k[len("state/") :]: v for k, v in expected.items() if k.startswith("state/")}
    # Gradients the step throws away (zero_grad() sets them to None) are not state of the
    # bundle since the exporter learned so; v1.0's bundles predate that and keep them.
    want = {k: v for k, v in want.items() if k in state or not k.endswith(".grad")}
    assert set(want) <= set(state)
    for k, v in want.items():
        assert rel(state[k], v) <= 1e-5, k
    # The loss moved: state is written back between steps.
    losses = expected["metric/loss"]
    assert losses[0] != losses[-1]


def test_golden_eval_entry_reads_state_without_changing_it() -> None:
    trainer = load(golden_bundle("linear_adamw"))
    expected = golden_expected("linear_adamw")
    batch = golden_batches("linear_adamw")[1]
    before = trainer.state_dict()
    out = trainer.evaluate(batch)
    assert set(out) == {"loss", "pred_mean"}
    for k in out:
        assert rel(np.asarray(out[k]), expected[f"eval/{k}"]) <= 1e-5, k
    after = trainer.state_dict()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    # Evaluating twice gives the same answer: nothing was donated.
    again = trainer.evaluate(batch)
    assert float(again["loss"]) == float(out["loss"])


def test_short_last_batch_picks_its_own_bucket() -> None:
    trainer = load(golden_bundle("linear_adamw"))
    full = golden_batches("linear_adamw")[0]
    short = {k: v[:5] for k, v in full.items()}
    w, b = trainer.state_dict()["weight"], trainer.state_dict()["bias"]
    loss = float(trainer.step(short)["loss"])
    pred = short["x"].astype(np.float64) @ w.T.astype(np.float64) + b
    assert loss == pytest.approx(float(np.mean((pred - short["y"]) ** 2)), rel=1e-5)
    assert trainer.step_count == 1
    # And the full bucket still works after it, on the updated state.
    trainer.step(full)
    assert trainer.step_count == 2
