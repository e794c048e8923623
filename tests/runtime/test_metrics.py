"""runtime.metrics: a step's metrics as plain Python floats that JSON accepts."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import load
from stepbundle.runtime.train.metrics import json_float, json_safe, to_floats, to_json_floats


def _strict(text: str) -> object:
    def refuse(token: str) -> object:
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_device_arrays_become_plain_floats_and_lists() -> None:
    metrics = {
        "loss": jnp.float32(1.5),
        "correct": jnp.int32(27),
        "flag": jnp.bool_(True),
        "per_class": jnp.arange(3, dtype=jnp.float32),
        "grid": jnp.ones((2, 2), dtype=jnp.bfloat16),
        "one": jnp.ones((1, 1)),
        "host": np.float64(0.25),
    }
    out = to_floats(metrics)
    assert out == {
        "loss": 1.5,
        "correct": 27.0,
        "flag": 1.0,
        "per_class": [0.0, 1.0, 2.0],
        "grid": [1.0, 1.0, 1.0, 1.0],
        "one": 1.0,
        "host": 0.25,
    }
    assert list(out) == list(metrics)  # order kept
    for v in out.values():
        items = v if isinstance(v, list) else [v]
        assert all(type(x) is float for x in items)
    assert _strict(json.dumps(out, allow_nan=False)) == out


def test_a_trainers_metrics_dump_as_json() -> None:
    t = load(golden_bundle("dropout_sgd"))
    metrics = t.step(golden_batches("dropout_sgd")[0])
    with pytest.raises(TypeError):
        json.dumps(metrics)  # what the helper is for
    floats = to_floats(metrics)
    assert set(floats) == {"loss", "accuracy"}
    assert floats["loss"] == float(metrics["loss"])
    assert _strict(json.dumps(to_json_floats(metrics), allow_nan=False)) == floats


def test_non_finite_values_stay_floats_and_become_strings_for_json() -> None:
    metrics = {
        "loss": jnp.float32(jnp.nan),
        "up": jnp.float32(jnp.inf),
        "v": jnp.array([-jnp.inf, 2.0, jnp.nan]),
    }
    floats = to_floats(metrics)
    assert isinstance(floats["loss"], float) and math.isnan(floats["loss"])
    assert floats["up"] == math.inf
    safe = to_json_floats(metrics)
    assert safe == {"loss": "NaN", "up": "Infinity", "v": ["-Infinity", 2.0, "NaN"]}
    assert json_safe(floats) == safe
    back = _strict(json.dumps(safe, allow_nan=False))
    assert back == safe
    # The strings are the spellings float() reads back.
    assert float(safe["up"]) == math.inf and math.isnan(float(safe["loss"]))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("x", "want"),
    [
        (0.0, 0.0),
        (-1e300, -1e300),
        (math.nan, "NaN"),
        (math.inf, "Infinity"),
        (-math.inf, "-Infinity"),
    ],
)
def test_json_float(x: float, want: float | str) -> None:
    assert json_float(x) == want
