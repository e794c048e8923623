"""A step's metrics as plain Python numbers, for printing, JSON and summary writers.

The trainer returns metrics as device arrays: they behave like numbers, but
``json.dumps`` refuses them and every read is a device round trip. :func:`to_floats`
turns them into ``float`` (a scalar metric) or a flat ``list[float]`` (any other shape,
C order); :func:`to_json_floats` does the same with non-finite values spelled so that
strict JSON accepts them.

Reading a metric waits for the step that produced it: dispatch is asynchronous, and
the numbers only exist once the step has run. So converting the metrics of every step
makes the host wait for the device every step; a caller that logs every N steps should
convert only those steps' metrics.

Imports: numpy and the standard library (no jax import, no torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np

__all__ = [
    "JsonFloat",
    "StepMetric",
    "json_float",
    "json_safe",
    "to_floats",
    "to_json_floats",
]

# What a float becomes in strict JSON: the number itself when finite, else one of the
# strings "NaN", "Infinity", "-Infinity" (the spellings Python's float() and
# JavaScript's Number() parse back).
JsonFloat: TypeAlias = float | str


class StepMetric:
    """One step's metric from a K-step call: row ``index`` of the call's metric stack.

    It behaves like the device array a single step returns (``float(m)``,
    ``np.asarray(m)``, ``shape``, ``dtype``). Reading it waits for the call and copies
    the whole stack to the host once: the other K - 1 steps' rows are then read from
    that copy, not from the device.
    """

    __slots__ = ("index", "stack")

    def __init__(self, stack: Any, index: int) -> None:
        self.stack = stack
        self.index = index

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self) -> np.dtype[Any]:
        dtype: np.dtype[Any] = np.dtype(self.stack.dtype)
        return dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        row = np.asarray(self.stack)[self.index]  # jax keeps the host copy of the stack
        return row.astype(dtype) if dtype is not None else np.array(row)

    def __float__(self) -> float:
        return float(np.asarray(self).reshape(()))

    def __int__(self) -> int:
        return int(np.asarray(self).reshape(()))

    def block_until_ready(self) -> StepMetric:
        self.stack.block_until_ready()
        return self

    def __repr__(self) -> str:
        return (
            f"StepMetric({np.asarray(self)!r}, step {self.index} of a {len(self.stack)}-step call)"
        )


def _value(v: Any) -> float | list[float]:
    a = np.asarray(v)  # waits for the step that produced ``v``
    if a.size == 1:
        return float(a.reshape(()))
    return [float(x) for x in a.reshape(-1)]


def to_floats(metrics: Mapping[str, Any]) -> dict[str, float | list[float]]:
    """Return ``metrics`` as plain Python numbers, one entry per metric, in order.

    A metric with one element becomes a ``float``; any other becomes a flat
    ``list[float]`` in C order. Integer and boolean metrics become floats too, so
    every value has one type. Non-finite values stay ``float('nan')`` and
    ``float('inf')``: fine for arithmetic and summary writers, but ``json.dumps``
    writes them as the non-standard ``NaN``/``Infinity`` tokens; use
    :func:`to_json_floats` for JSON.

    Reading a metric blocks until the step that produced it has finished (see the
    module docstring); nothing else is waited for.
    """
    return {name: _value(v) for name, v in metrics.items()}


def json_float(x: float) -> JsonFloat:
    """``x`` if finite, else ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``."""
    if math.isfinite(x):
        return x
    if math.isnan(x):
        return "NaN"
    return "Infinity" if x > 0 else "-Infinity"


def json_safe(
    floats: Mapping[str, float | list[float]],
) -> dict[str, JsonFloat | list[JsonFloat]]:
    """:func:`to_floats`'s result with every non-finite value made a string by
    :func:`json_float`; reads nothing from a device."""
    return {
        name: [json_float(x) for x in v] if isinstance(v, list) else json_float(v)
        for name, v in floats.items()
    }


def to_json_floats(metrics: Mapping[str, Any]) -> dict[str, JsonFloat | list[JsonFloat]]:
    """:func:`to_floats`, with non-finite values as the strings ``"NaN"``,
    ``"Infinity"`` and ``"-Infinity"``, so ``json.dumps(..., allow_nan=False)``
    accepts the result and any strict JSON reader can parse it.

    Strings rather than ``null`` keep which non-finite value it was; ``float(s)``
    turns each back into the number. Blocks like :func:`to_floats`.
    """
    return json_safe(to_floats(metrics))
