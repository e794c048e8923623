"""Hyperparameters: the named scalars a trainer feeds its programs, and their schedules.

``Hyperparameters`` holds each hyperparameter's current value, its device copy (made
when a step first needs it, dropped when the value changes) and the schedules that set
values before every training step. A short name reaches every optimizer group: ``lr``
means each ``param_groups.<i>.lr``.

The trainer's hot path reads ``values``, ``buffers`` and ``schedules`` directly (the
same dict objects), so a step costs no more than it did with them on the trainer.

Imports: numpy, stepbundle.schema.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from stepbundle.schema.manifest import Manifest

from .dtypes import to_numpy
from .errors import BindingError

__all__ = ["Hyperparameters", "Schedule"]

Schedule = Callable[[int], float]
"""A function of the number of steps taken so far, returning the value for the next."""


class Hyperparameters:
    """Current hyperparameter values, their device copies and their schedules.

    Attributes:
      values: the current value of every hyperparameter, by full name.
      buffers: device copies of values, by name; missing means "make it on next use".
      schedules: the schedule of each scheduled hyperparameter, by full name.
    """

    def __init__(
        self,
        manifest: Manifest,
        values: Mapping[str, float],
        put_scalar: Callable[[np.ndarray[Any, Any]], Any],
    ) -> None:
        self.values: dict[str, float] = dict(values)
        self.buffers: dict[str, Any] = {}
        self.schedules: dict[str, Schedule] = {}
        self._dtypes = {h.name: to_numpy(h.spec.dtype) for h in manifest.hyperparameters}
        self._put_scalar = put_scalar

    def resolve(self, name: str) -> list[str]:
        """The full names ``name`` stands for: itself, or every group's ``<name>``."""
        if name in self.values:
            return [name]
        matches = [
            n for n in self.values if n.startswith("param_groups.") and n.rsplit(".", 1)[-1] == name
        ]
        if matches:
            return matches
        known = ", ".join(sorted(self.values)) or "none"
        raise BindingError(
            f"The bundle has no hyperparameter {name!r} (it has: {known}). Declare it at "
            "export with Recipe(hyperparameters=(...))."
        )

    def set(self, name: str, value: float) -> None:
        """Set ``name`` (every group's, for a short name) to a finite ``value``."""
        v = float(value)
        if not math.isfinite(v):
            raise BindingError(f"Hyperparameter {name!r} must be finite, got {value!r}.")
        for n in self.resolve(name):
            if self.values[n] != v:
                self.values[n] = v
                self.buffers.pop(n, None)

    def set_schedule(self, name: str, schedule: Schedule | None) -> None:
        """Drive ``name`` by ``schedule``; ``None`` removes its schedule."""
        for n in self.resolve(name):
            if schedule is None:
                self.schedules.pop(n, None)
            else:
                self.schedules[n] = schedule

    def buffer(self, name: str) -> Any:
        """The device copy of ``name``'s current value (made once per value)."""
        buf = self.buffers.get(name)
        if buf is None:
            buf = self._put_scalar(np.asarray(self.values[name], dtype=self._dtypes[name]))
            self.buffers[name] = buf
        return buf
