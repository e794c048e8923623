"""``graph.evaluate`` holds each value as its element type holds it (stablehlo/graph.py):
``converted`` rounds to bf16, f16 and f32 as numpy (with ml_dtypes) does, and says
"unknown" (None) where a type cannot hold the value exactly (an integer out of range,
which XLA would wrap); ``holds_integers`` says which iotas are exact. A causal mask built
from positions rounded or wrapped by their type is then not taken for causal
(tests/exporter/test_attention_misses.py)."""

from __future__ import annotations

import numpy as np
import pytest

from stepbundle.stablehlo.graph import converted, holds_integers

ml_dtypes = pytest.importorskip("ml_dtypes")  # jax's own dependency

FLOATS = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32, "f64": np.float64}
VALUES = [0.0, 1.0, -3.0, 255.0, 256.0, 257.0, 259.0, 383.0, 0.1, -1e-3, 2049.0, 2051.0]
VALUES += [65519.0, 65520.0, 3.3e38, 1e-40, 3e-8, 1e-45]  # near overflow; subnormals


@pytest.mark.parametrize("elem", list(FLOATS))
def test_floats_round_as_numpy_rounds(elem: str) -> None:
    for x in VALUES:
        want = np.array(x, np.float64).astype(FLOATS[elem])
        got = converted(x, elem)
        if not np.isfinite(want):
            assert got is None, (elem, x)  # beyond the type's range: not modelled
        else:
            assert got == float(want), (elem, x, got, float(want))


@pytest.mark.parametrize(
    ("elem", "dtype"), [("i8", np.int8), ("ui8", np.uint8), ("i16", np.int16), ("i32", np.int32)]
)
def test_integers_in_range_are_kept_and_the_rest_are_unknown(elem: str, dtype: type) -> None:
    info = np.iinfo(dtype)
    for x in [0, 1, -1, 127, 128, 255, 256, -129, 40000, 3.7, -3.7]:
        inside = info.min <= int(x) <= info.max
        got = converted(x, elem)
        assert got == (int(np.array(x).astype(dtype)) if inside else None), (elem, x)
    assert converted(float("nan"), elem) is None


def test_iotas_are_exact_up_to_the_types_limits() -> None:
    assert holds_integers("bf16", 257) and not holds_integers("bf16", 258)  # 0..256
    assert holds_integers("f16", 2049) and not holds_integers("f16", 2050)
    assert holds_integers("i8", 128) and not holds_integers("i8", 129)
    assert holds_integers("ui8", 256) and not holds_integers("ui8", 257)
    assert holds_integers("i32", 1 << 20) and holds_integers("f32", 1 << 20)
    assert not holds_integers("f8E4M3FN", 2)  # a type not modelled: never exact
    # numpy agrees on where bf16 stops holding every position
    pos = np.arange(260, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.array_equal(pos[:257], np.arange(257)) and pos[257] != 257
