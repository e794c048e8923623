"""Hyperparameters: the named scalars a trainer feeds its programs, and their schedules.

``Hyperparameters`` (the trainer's hyperparameter table) holds each hyperparameter's
current value, its device copy (made when a step first needs it, dropped when the value
changes), the schedules that set values before every training step, and the names a
restored checkpoint left waiting for a Python schedule. A short name reaches every optimizer group: ``lr``
means each ``param_groups.<i>.lr``, ``betas.0`` (Adam's beta1) each ``param_groups.<i>.betas.0``.

The trainer's hot path calls ``apply_schedules`` only when ``schedules`` is not empty,
and ``buffer`` per hyperparameter argument.

Imports: numpy, stepbundle.schema.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from stepbundle.schema.manifest import Manifest

from ..dtypes import to_numpy
from ..errors import BindingError
from .schedule import parse_schedule, refuse_clash, schedule_extremes

__all__ = ["Hyperparameters", "Schedule"]

Schedule = Callable[[int], float]
"""A function of the number of steps taken so far, returning the value for the next."""


class Hyperparameters:
    """Current hyperparameter values, their device copies and their schedules.

    Attributes:
      values: the current value of every hyperparameter, by full name.
      buffers: device copies of values, by name; missing means "make it on next use".
      schedules: the schedule of each scheduled hyperparameter, by full name.
      specs: the spec each schedule was made from, or None for a Python function.
      pending: names a restored checkpoint had under a Python schedule, which it cannot
        store: steps are refused until the caller sets (or removes) their schedule.
      restored: the schedule specs (None: a Python function) the last restored
        checkpoint stored, by full name: a resumed run continues them, and
        ``set_schedule`` refuses another schedule for one (``schedule.refuse_clash``)
        unless told to replace it.
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
        # The spec each schedule was made from (``warmup_cosine:...``), or None for a
        # Python function: specs go into checkpoints, so a resume continues them.
        self.specs: dict[str, str | None] = {}
        self.pending: set[str] = set()
        self.restored: dict[str, str | None] = {}
        self._dtypes = {h.name: to_numpy(h.spec.dtype) for h in manifest.hyperparameters}
        self._put_scalar = put_scalar
        self._zero_lr_refused = _has_capturable_adam(manifest)
        self._stacked: dict[str, tuple[tuple[float, ...], Any]] = {}

    def resolve(self, name: str) -> list[str]:
        """The full names ``name`` stands for: itself, or every group's ``<name>``."""
        if name in self.values:
            return [name]
        # ``param_groups.<i>.<key>``: the key may itself be dotted (``betas.0``).
        matches = [
            n
            for n in self.values
            if n.startswith("param_groups.") and n.split(".", 2)[2:] == [name]
        ]
        if matches:
            return matches
        known = ", ".join(sorted(self.values)) or "none"
        raise BindingError(
            f"The bundle has no hyperparameter {name!r} (it has: {known}). Declare it at "
            "export with Recipe(hyperparameters=(...))."
        )

    def check(self, name: str, value: float, *, source: str) -> None:
        """Refuse a value no step may receive: not finite, or an lr that is 0 for
        capturable Adam/AdamW (whose update then divides 0 by 0 where a second moment
        is 0, turning those parameters into NaN in one step). The value checked is the
        one the device receives: cast to the dtype the bundle declares (1e-46 is 0 as
        float32), and an lr below that dtype's smallest normal number counts as 0 too
        (1e-44 is a float32 subnormal, which a TPU, or a GPU with flush-to-zero, reads
        as 0)."""
        if not math.isfinite(value):
            raise BindingError(
                f"Hyperparameter {name!r} must be finite, but {source} gave {value!r}."
            )
        for full in self.resolve(name):
            dtype = self._dtypes.get(full)
            if dtype is not None and dtype.kind == "f" and abs(value) > float(np.finfo(dtype).max):
                raise BindingError(
                    f"Hyperparameter {full!r} is {dtype}, and {source} gave {value!r}, which "
                    f"is infinite as {dtype} (largest {float(np.finfo(dtype).max)!r})."
                )
            if not (self._zero_lr_refused and full.rsplit(".", 1)[-1] == "lr"):
                continue
            seen = value if dtype is None else float(np.asarray(value, dtype=dtype))
            tiny = 0.0 if dtype is None or dtype.kind != "f" else float(np.finfo(dtype).tiny)
            if seen != 0.0 and abs(seen) >= tiny:
                continue
            if value == 0.0:
                given = f"{name!r} = 0"
            elif seen == 0.0:
                given = (
                    f"{name!r} = {value!r}, which is 0 as {dtype} (the dtype the bundle "
                    f"declares for {full!r})"
                )
            else:
                given = (
                    f"{name!r} = {value!r}, which is a subnormal {dtype} (the dtype the "
                    f"bundle declares for {full!r}; its smallest normal number is {tiny!r}), "
                    "and accelerators (TPUs; GPUs with flush-to-zero) flush subnormals to 0"
                )
            raise BindingError(
                f"{source[:1].upper()}{source[1:]} gave {given}. This bundle's optimizer "
                "is capturable Adam/AdamW, whose update with an lr of exactly 0 computes "
                "0/0 and turns parameters into NaN. Use a small positive lr (e.g. 1e-12; "
                "a schedule's min=1e-12), or stop training instead."
            )

    def check_schedule(self, name: str, spec: str) -> None:
        """Refuse a schedule spec ``parse_schedule`` does not take (ValueError), or whose
        start or end value ``check`` refuses (BindingError)."""
        parse_schedule(spec)
        for extreme in schedule_extremes(spec):
            self.check(name, extreme, source=f"the schedule {spec!r}")

    @staticmethod
    def check_spec(spec: str) -> None:
        """Raise ValueError if ``spec`` is not a schedule spec ``parse_schedule`` takes."""
        parse_schedule(spec)

    def set(self, name: str, value: float) -> None:
        """Set ``name`` (every group's, for a short name) to a finite ``value``."""
        try:
            v = float(value)
        except (OverflowError, TypeError, ValueError):
            raise BindingError(
                f"Hyperparameter {name!r} must be a finite number, got {value!r:.100}."
            ) from None
        self.check(name, v, source="set_hyperparameter")
        for n in self.resolve(name):
            if self.values[n] != v:
                self.values[n] = v
                self.buffers.pop(n, None)

    def set_schedule(self, name: str, schedule: Schedule | str | None) -> None:
        """Drive ``name`` by ``schedule``: a function of the step, a spec string such as
        ``warmup_cosine:peak=1e-3,warmup=100,total=10000`` (stored in checkpoints), or
        ``None`` to remove it."""
        spec: str | None = None
        if isinstance(schedule, str):
            spec = schedule
            self.check_schedule(name, spec)
            schedule = parse_schedule(spec)
        for n in self.resolve(name):
            if schedule is None:
                self.schedules.pop(n, None)
                self.specs.pop(n, None)
            else:
                self.schedules[n] = schedule
                self.specs[n] = spec

    def set_by_caller(
        self, name: str, schedule: Schedule | str | None, *, replace: bool = False
    ) -> None:
        """``Trainer.set_schedule``: ``set_schedule``, refused (``UsageError``) where it
        would replace a schedule the last checkpoint restored (``restored``), unless
        ``replace``; removing a schedule (None) is never refused. A spec is checked
        before the clash, so a bad one is named first."""
        spec = schedule if isinstance(schedule, str) else None
        if spec is not None:
            self.check_spec(spec)  # its values are checked as it is set
        if schedule is not None and not replace:
            refuse_clash(self.restored, name, spec)
        self.set_schedule(name, schedule)
        self.forget_pending(name)
        if schedule is None or replace:  # the caller's own schedule from here on
            for n in self.resolve(name):
                self.restored.pop(n, None)

    def forget_pending(self, name: str) -> None:
        """The caller set ``name``'s schedule again (or removed it): nothing waits for it."""
        self.pending.difference_update(self.resolve(name))

    def check_pending(self) -> None:
        """Refuse to step while a restored Python schedule has not been set again."""
        if self.pending:
            names = ", ".join(sorted(self.pending))
            raise BindingError(
                f"The checkpoint was saved while {names} followed a Python schedule, which "
                "checkpoints cannot store. Call set_schedule(name, fn) again before "
                "stepping (or set_schedule(name, None) to keep the checkpoint's value)."
            )

    def apply_schedules(self, step: int) -> None:
        """Set every scheduled value for the step after ``step`` steps, each checked before
        it is set (the step is then not dispatched: nothing was donated)."""
        for name, fn in self.schedules.items():
            v = float(fn(step))
            if self.values[name] != v:
                self.check(name, v, source=f"the schedule of {name!r} at step {step}")
                self.values[name] = v
                self.buffers.pop(name, None)

    def settle(self, rows: Mapping[str, tuple[float, ...]]) -> None:
        """After a K-step call of ``rows``: each value is the one its last step received."""
        for name, row in rows.items():
            if self.values[name] != row[-1]:
                self.values[name] = row[-1]
                self.buffers.pop(name, None)

    def rows(self, step: int, k: int) -> dict[str, tuple[float, ...]]:
        """Every hyperparameter's values for the ``k`` steps from ``step`` (a K-step
        call): its schedule's, each checked as a single step checks it, or its
        current value ``k`` times."""
        out: dict[str, tuple[float, ...]] = {}
        for name, value in self.values.items():
            fn = self.schedules.get(name)
            if fn is None:
                out[name] = (value,) * k
                continue
            row = []
            for j in range(k):
                v = float(fn(step + j))
                if v != value:
                    self.check(name, v, source=f"the schedule of {name!r} at step {step + j}")
                    value = v
                row.append(v)
            out[name] = tuple(row)
        return out

    def stacked_buffer(self, name: str, row: tuple[float, ...]) -> Any:
        """The device copy of ``row``, one value per step of a K-step call (the last
        row's copy is kept: without a schedule every call reuses it)."""
        kept = self._stacked.get(name)
        if kept is not None and kept[0] == row:
            return kept[1]
        buf = self._put_scalar(np.asarray(row, dtype=self._dtypes[name]))
        self._stacked[name] = (row, buf)
        return buf

    def buffer(self, name: str) -> Any:
        """The device copy of ``name``'s current value (made once per value)."""
        buf = self.buffers.get(name)
        if buf is None:
            buf = self._put_scalar(np.asarray(self.values[name], dtype=self._dtypes[name]))
            self.buffers[name] = buf
        return buf


def _has_capturable_adam(manifest: Manifest) -> bool:
    """Whether the optimizer state is Adam/AdamW's with its step count on the device.

    The bundle does not name its optimizer; its state does: ``exp_avg_sq`` moments with
    a tensor ``step`` beside them are torch's capturable Adam/AdamW (the only Adam
    family the exporter takes from a fresh optimizer).
    """
    names = {e.name for e in manifest.state}
    return any(
        n.endswith(".exp_avg_sq") and n[: -len("exp_avg_sq")] + "step" in names for n in names
    )
