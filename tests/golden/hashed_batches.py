"""Batches computed from a hash of each element's index: the same bits on every host.

The float64 golden of tests/runtime/test_cpu_numerics_stem.py trains on four batches of
32 64x64 images (6 MB as float32). Committing them would be most of the golden; instead
both the script that made it (tests/golden/make_float64_stem.py, with torch) and the test
(the lean environment) compute them here, from integers only (SplitMix64), so no libm or
SIMD path of any host changes a bit.

Imports: numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["hashed_batches"]

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(index: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as SplitMix64 means it to
        z = (index + np.uint64(1)) * _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _uniform(seed: int, n: int) -> np.ndarray:
    """n float64 values in [0, 1), multiples of 2^-24 (exact in float32)."""
    index = np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(1 << 40)
    return (_splitmix64(index) >> np.uint64(40)).astype(np.float64) / float(1 << 24)


def hashed_batches(
    n: int, batch: int, shape: tuple[int, ...], classes: int
) -> list[dict[str, np.ndarray]]:
    """``n`` batches ``{"x": float32[batch, *shape], "y": int64[batch]}``: x has mean 0
    and variance 1 (the sum of two uniforms, centred and scaled), y a class in
    ``[0, classes)``."""
    size = batch * int(np.prod(shape))
    out = []
    for i in range(n):
        u = _uniform(3 * i, size) + _uniform(3 * i + 1, size) - 1.0  # triangular on (-1, 1)
        x = (u * np.sqrt(6.0)).astype(np.float32).reshape(batch, *shape)
        y = (
            _splitmix64(
                np.arange(batch, dtype=np.uint64) + np.uint64(3 * i + 2) * np.uint64(1 << 40)
            )
            % np.uint64(classes)
        ).astype(np.int64)
        out.append({"x": x, "y": y})
    return out
