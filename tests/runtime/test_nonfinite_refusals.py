"""Non-finite hyperparameters never get in, and evaluate() never loses the state.

A NaN or infinite hyperparameter (from a bundle, --set, a schedule spec or a schedule
function, or checkpoint metadata) is refused with the name of the value before anything
is dispatched; an entry that updates state is refused by evaluate() before dispatch.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import GOLDEN_DIR, golden_batches, golden_bundle

from stepbundle.runtime import BindingError, CheckpointError, load
from stepbundle.runtime.state.checkpoint import CheckpointMeta
from stepbundle.runtime.train.schedule import parse_schedule
from stepbundle.schema import SchemaValidationError, open_bundle, validate


def test_evaluate_refuses_an_entry_that_updates_state_and_keeps_it() -> None:
    t = load(golden_bundle("linear_adamw"))
    batch = golden_batches("linear_adamw")[0]
    before = t.state_dict()
    with pytest.raises(BindingError, match="'train' updates the state") as refused:
        t.evaluate(batch, entry="train")
    assert "'eval'" in str(refused.value)  # it names the read-only entries
    after = t.state_dict()
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v)
    assert math.isfinite(float(t.step(batch)["loss"]))  # nothing was donated


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("constant:value=nan", "value='nan' in 'constant:value=nan' must be finite"),
        ("constant:value=inf", "must be finite"),
        ("warmup_cosine:peak=1e-3,warmup=10,total=1e400", "total='1e400'"),
        ("warmup_cosine:peak=1e-3,warmup=-1,total=100", "warmup='-1'"),
        ("linear:start=1,end=0,total=2.5", "is a step count"),
    ],
)
def test_schedule_specs_with_bad_numbers_are_refused(spec: str, needle: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_schedule(spec)
    assert needle in str(refused.value)


def test_a_schedule_function_that_returns_nan_is_refused_before_dispatch() -> None:
    t = load(golden_bundle("batchnorm_lr"))
    batches = golden_batches("batchnorm_lr")
    t.step(batches[0])
    t.set_schedule("lr", lambda step: float("nan") if step == 1 else 0.01)
    before = t.state_dict()
    with pytest.raises(
        BindingError, match="'lr' must be finite, but the schedule of 'lr' at step 1 gave nan"
    ):
        t.step(batches[1])
    assert t.step_count == 1
    for k, v in t.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    t.set_schedule("lr", None)
    assert math.isfinite(float(t.step(batches[1])["loss"]))


def test_cli_refuses_a_nan_schedule_in_one_line() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepbundle",
            "run",
            str(golden_bundle("linear_adamw")),
            "--data",
            str(GOLDEN_DIR / "linear_adamw.inputs.npz"),
            "--steps",
            "2",
            "--lr-schedule",
            "constant:value=nan",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2  # a bad argument (a UsageError)
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("must be finite.")


def test_a_bundle_with_a_nan_hyperparameter_is_refused() -> None:
    with open_bundle(golden_bundle("batchnorm_lr")) as b:
        m, size = b.manifest, b.file_size
    h = m.hyperparameters[0]
    bad = dataclasses.replace(m, hyperparameters=(dataclasses.replace(h, value=math.nan),))
    with pytest.raises(SchemaValidationError) as refused:
        validate(bad, size)
    assert refused.value.path == "hyperparameters[0].value"
    assert f"hyperparameter {h.name!r} has the value nan" in str(refused.value)


def test_checkpoint_metadata_with_a_nan_hyperparameter_is_never_written(tmp_path: Path) -> None:
    meta = CheckpointMeta(1, 3, None, {"lr": math.inf}, "sha256:" + "0" * 64)
    with pytest.raises(CheckpointError, match=r"not finite: \{'lr': inf\}"):
        meta.to_json()


def test_a_value_infinite_in_the_hyperparameters_dtype_is_refused() -> None:
    t = load(golden_bundle("batchnorm_lr"))  # lr is float32
    with pytest.raises(BindingError, match=r"is float32, and set_hyperparameter gave 1e\+39"):
        t.set_hyperparameter("lr", 1e39)
    with pytest.raises(BindingError, match="must be a finite number, got 1000"):
        t.set_hyperparameter("lr", 10**400)
    with pytest.raises(BindingError, match="infinite as float32"):
        t.set_schedule("lr", "constant:value=1e39")
    assert t.hyperparameters["lr"] == pytest.approx(0.01)
    with open_bundle(golden_bundle("batchnorm_lr")) as b:
        m, size = b.manifest, b.file_size
    h = dataclasses.replace(m.hyperparameters[0], value=1e39)
    with pytest.raises(SchemaValidationError, match="infinite as f32"):
        validate(dataclasses.replace(m, hyperparameters=(h,)), size)


def test_a_schedule_that_reaches_zero_is_refused_for_capturable_adam() -> None:
    t = load(golden_bundle("batchnorm_lr"))  # capturable Adam
    with pytest.raises(
        BindingError, match=r"gave 'lr' = 0\. This bundle's optimizer is capturable"
    ):
        t.set_schedule("lr", "warmup_cosine:peak=1e-3,warmup=10,total=100")  # min defaults to 0
    with pytest.raises(BindingError, match="gave 'lr' = 0"):
        t.set_schedule("lr", "linear:start=0,end=1e-3,total=10")
    t.set_schedule("lr", "warmup_cosine:peak=1e-3,warmup=10,total=100,min=1e-6")
    assert t.schedules == {"lr": "warmup_cosine:peak=1e-3,warmup=10,total=100,min=1e-6"}
    # A Python schedule that reaches 0 is refused at that step, before dispatch.
    t.set_schedule("lr", lambda step: 0.0 if step >= 1 else 1e-3)
    batches = golden_batches("batchnorm_lr")
    t.step(batches[0])
    with pytest.raises(BindingError, match="at step 1 gave 'lr' = 0"):
        t.step(batches[1])
    assert t.step_count == 1
    # SGD allows an lr of 0: nothing is refused there (dropout_sgd declares no lr, so
    # the refusal is keyed on the optimizer's state, not on the name).
    assert not load(golden_bundle("dropout_sgd")).schedules
