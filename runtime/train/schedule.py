"""Hyperparameter schedules the runtime drives, parsed from short specs.

``warmup_cosine:peak=1e-3,warmup=100,total=10000[,min=0]``: linear warmup over the first
``warmup`` steps, ``peak * (step + 1) / (warmup + 1)`` (never 0: an lr of exactly 0 makes
torch's capturable Adam write NaN where a second moment is 0), then a half cosine from
``peak`` at step ``warmup`` down to ``min`` at step ``total``.
``constant:value=1e-3``. ``linear:start=1e-3,end=0,total=1000``.
Step ``k`` is the number of steps taken before the one the value is used for.

A schedule may name its hyperparameter, ``[NAME=]SPEC`` (``named_schedule``; NAME
defaults to ``lr``), and a resumed run continues the schedules its checkpoint stores:
asking it for another schedule of the same hyperparameter is a clash (``schedule_clash``),
which ``Trainer.set_schedule`` refuses (``refuse_clash``), for ``stepbundle run
--lr-schedule`` and a Python caller alike.

Imports: standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from stepbundle.schema.errors import UsageError

__all__ = [
    "named_schedule",
    "parse_schedule",
    "refuse_clash",
    "schedule_clash",
    "schedule_extremes",
    "warmup_cosine",
]


def warmup_cosine(
    peak: float, warmup: int, total: int, min_value: float = 0.0
) -> Callable[[int], float]:
    """Linear warmup towards ``peak``, then cosine decay from ``peak`` to ``min_value``."""

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return peak * (step + 1) / (warmup + 1)
        span = max(1, total - warmup)
        t = min(1.0, (step - warmup) / span)
        return min_value + (peak - min_value) * 0.5 * (1.0 + math.cos(math.pi * t))

    return f


def _linear(start: float, end: float, total: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        t = min(1.0, step / max(1, total))
        return start + (end - start) * t

    return f


_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "warmup_cosine": (("peak", "warmup", "total"), ("min",)),
    "constant": (("value",), ()),
    "linear": (("start", "end", "total"), ()),
}


_STEP_COUNTS = frozenset({"warmup", "total"})


def parse_schedule(spec: str) -> Callable[[int], float]:
    """Parse ``kind:key=value,...`` into a function of the step index."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in _KINDS:
        raise UsageError(
            f"Unknown schedule {kind!r} in {spec!r}; use one of {', '.join(_KINDS)}, e.g. "
            "warmup_cosine:peak=1e-3,warmup=100,total=10000."
        )
    required, optional = _KINDS[kind]
    params: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in required + optional:
            raise UsageError(
                f"Bad schedule parameter {item!r} in {spec!r}; {kind} takes "
                f"{', '.join(required + optional)} as key=value."
            )
        try:
            params[key] = float(value)
        except ValueError:
            raise UsageError(f"Schedule parameter {key}={value!r} is not a number.") from None
        if not math.isfinite(params[key]):
            raise UsageError(f"Schedule parameter {key}={value!r} in {spec!r} must be finite.")
        if key in _STEP_COUNTS and (params[key] < 0 or params[key] != int(params[key])):
            raise UsageError(
                f"Schedule parameter {key}={value!r} in {spec!r} is a step count: a whole "
                "number >= 0."
            )
    missing = [k for k in required if k not in params]
    if missing:
        raise UsageError(f"Schedule {spec!r} is missing {', '.join(missing)}.")
    if kind == "warmup_cosine":
        return warmup_cosine(
            params["peak"], int(params["warmup"]), int(params["total"]), params.get("min", 0.0)
        )
    if kind == "constant":
        constant = params["value"]
        return lambda _step: constant
    return _linear(params["start"], params["end"], int(params["total"]))


def schedule_extremes(spec: str) -> list[float]:
    """The values a schedule spec starts from and settles at: ``peak`` and ``min`` of
    warmup_cosine, ``start`` and ``end`` of linear, ``value`` of constant. Every value
    the schedule gives lies between them (``parse_schedule`` has checked the spec)."""
    kind, _, rest = spec.partition(":")
    params = {k.strip(): v for k, _, v in (p.partition("=") for p in rest.split(",") if p.strip())}
    keys = {
        "warmup_cosine": (("peak", "0"), ("min", "0")),
        "linear": (("start", "0"), ("end", "0")),
        "constant": (("value", "0"),),
    }.get(kind.strip(), ())
    return [float(params.get(k, default)) for k, default in keys]


def named_schedule(text: str) -> tuple[str, str]:
    """``[NAME=]SPEC`` as (NAME, SPEC): ``betas.0=linear:...`` names ``betas.0``; a
    spec alone (``warmup_cosine:peak=1e-3,...``) schedules ``lr``."""
    if "=" in text.split(":", 1)[0]:
        name, _, spec = text.partition("=")
        return name, spec
    return "lr", text


def schedule_clash(
    restored: Mapping[str, str | None], name: str, spec: str | None
) -> tuple[str, str] | None:
    """The schedule a resumed trainer continues that ``spec`` for ``name`` would replace.

    ``restored`` is the schedules a checkpoint restored (``Trainer.load_checkpoint``): a
    resumed run continues them, so another schedule for the same hyperparameter (its
    full name, or one ending in ``.NAME``) clashes: a different spec, or a Python
    function (``spec`` None), which no stored spec can be known to equal. The same spec,
    or a hyperparameter the checkpoint schedules by a Python function (None), does not.
    Returns the first clash as (its full name, the spec it follows), or None.
    """
    for full, old in restored.items():
        if (full == name or full.endswith(f".{name}")) and old is not None and old != spec:
            return full, old
    return None


def refuse_clash(restored: Mapping[str, str | None], name: str, spec: str | None) -> None:
    """Raise ``UsageError`` if ``spec`` for ``name`` (None: a Python function) clashes
    with a schedule a checkpoint restored (``schedule_clash``), naming both and the ways
    out."""
    clash = schedule_clash(restored, name, spec)
    if clash is None:
        return
    full, old = clash
    given = f"The schedule {spec!r}" if spec is not None else "A Python function as the schedule"
    raise UsageError(
        f"{given} for {name!r} conflicts with the checkpoint, whose {full!r} follows "
        f"{old!r}. A resumed run continues the checkpoint's schedule: give the same spec, or "
        "none (drop --lr-schedule, or the set_schedule call); from Python, "
        "set_schedule(name, schedule, replace=True) replaces it on purpose."
    )
