"""--stop-on-nonfinite watches every metric and, with check_state, the new state: a step
that would spoil the state is not applied, and the state from before it is kept."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import (
    LoadOptions,
    NonFiniteLossError,
    SafetyOptions,
    UsageError,
    load,
)


def poisoned(name: str) -> dict[str, np.ndarray]:
    batch = {k: v.copy() for k, v in golden_batches(name)[1].items()}
    batch["x"].reshape(-1)[3] = np.nan  # one NaN "pixel"
    return batch


def test_a_nan_input_is_stopped_before_it_reaches_the_state() -> None:
    t = load(
        golden_bundle("batchnorm_lr"),
        options=LoadOptions(
            safety=SafetyOptions(stop_on_nonfinite=True, check_state=True),
        ),
    )
    t.step(golden_batches("batchnorm_lr")[0])
    before = t.state_dict()
    with pytest.raises(NonFiniteLossError) as stopped:
        t.step(poisoned("batchnorm_lr"))
    assert stopped.value.step == 1
    assert "kept the state from before this step" in str(stopped.value)
    assert t.step_count == 1
    for k, v in t.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    # Without the watch the same batch turns state tensors into NaN: the test has teeth.
    unwatched = load(golden_bundle("batchnorm_lr"))
    unwatched.step(golden_batches("batchnorm_lr")[0])
    unwatched.step(poisoned("batchnorm_lr"))
    spoiled = [k for k, v in unwatched.state_dict().items() if not np.isfinite(v).all()]
    assert spoiled


def test_every_metric_is_watched_not_only_the_loss() -> None:
    # linear_adamw's eval entry is not watched; its train entry has only "loss", so use
    # a NaN target: the loss itself is NaN and named in the message.
    t = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(safety=SafetyOptions(stop_on_nonfinite=True)),
    )
    batch = {k: v.copy() for k, v in golden_batches("linear_adamw")[0].items()}
    batch["y"][0, 0] = np.inf
    with pytest.raises(NonFiniteLossError, match=r"non-finite metrics \(loss = "):
        t.step(batch)
    assert t.step_count == 0


def test_check_state_needs_stop_on_nonfinite() -> None:
    with pytest.raises(UsageError, match="check_state=True needs stop_on_nonfinite=True"):
        load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(safety=SafetyOptions(check_state=True)),
        )
