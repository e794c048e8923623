"""A failure inside the device runtime during a step is a typed error, and a trainer whose
donated state may be gone refuses further use until state is loaded again."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import BindingError, DeviceError, load


def test_a_device_failure_is_a_device_error_and_a_checkpoint_recovers(tmp_path: Path) -> None:
    t = load(golden_bundle("linear_adamw"))
    batch = golden_batches("linear_adamw")[0]
    t.step(batch)
    t.save_checkpoint(tmp_path / "good.safetensors")
    good = t.state_dict()
    # Fault injection: a state buffer vanishes from the device (as after a lost device);
    # XLA refuses the execute, after the other buffers were handed over.
    t._store.buffers[0].delete()
    with pytest.raises(DeviceError, match="failed inside the device runtime") as failed:
        t.step(batch)
    assert "Load a checkpoint" in str(failed.value)
    with pytest.raises(BindingError, match="donated state buffers may be gone"):
        t.step(batch)
    with pytest.raises(BindingError, match="donated state buffers may be gone"):
        t.state_dict()
    t.load_checkpoint(tmp_path / "good.safetensors")
    for k, v in t.state_dict().items():
        np.testing.assert_array_equal(v, good[k])
    assert math.isfinite(float(t.step(batch)["loss"]))


def test_a_device_failure_during_evaluate_is_a_device_error_too() -> None:
    t = load(golden_bundle("linear_adamw"))
    t._store.buffers[0].delete()  # fault injection, as above
    with pytest.raises(DeviceError, match="it donated nothing"):
        t.evaluate(golden_batches("linear_adamw")[0])
