"""Batches: what is wrong with a batch no shape bucket takes, and data files as batches.

``BatchRouter`` is the trainer's part that holds every entry's plans (its shape
buckets), picks a batch's bucket and moves the batch to the device. ``mismatch_message`` explains, in
whole sentences, why a batch matches none of an entry's shape buckets (called only once
a batch was refused, never on the hot path). ``iter_batches`` splits an npz-style dict
of stacked arrays into batches.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import _compat
from ..dtypes import describe
from ..errors import BindingError
from ..placement.sharding import Placement
from .plan import CompiledPlan, Plan, RefusedPlan

__all__ = ["BatchRouter", "iter_batches", "mismatch_message"]


class BatchRouter:
    """Every entry's shape buckets; choosing a batch's bucket and placing the batch.

    Attributes:
      plans: each entry's plans, one per shape bucket (compiled, or refused on this
        placement).
      placement: where batches go.
    """

    def __init__(self, plans: Mapping[str, list[Plan]], placement: Placement) -> None:
        self.plans = plans
        self.placement = placement

    def plans_for(self, entry: str) -> list[Plan]:
        """The plans of ``entry``, or a ``BindingError`` naming the entries there are."""
        plans = self.plans.get(entry)
        if plans is None:
            raise BindingError(
                f"The bundle has no {entry!r} entry (it has: {', '.join(self.plans)}). "
                + ("Export it with Recipe(eval_step=...)." if entry == "eval" else "")
            )
        return plans

    def pick(
        self, entry: str, batch: Mapping[str, Any], local: bool = False
    ) -> tuple[CompiledPlan, dict[str, Any]]:
        """Choose the shape bucket for ``batch`` and move the batch to the device.

        ``local``: in a multi-process job, ``batch`` holds only this process's rows of
        the global batch (a ``Loader`` with ``process_count`` > 1 delivers that).
        Everything that can be wrong with a batch is found here, before dispatch.
        """
        chosen, arrays = self.match(entry, self.plans_for(entry), batch, local)
        return chosen, self.transfer(chosen, arrays, local)

    def match(
        self, entry: str, plans: Sequence[Plan], batch: Mapping[str, Any], local: bool = False
    ) -> tuple[CompiledPlan, dict[str, Any]]:
        """The shape bucket of ``plans`` that takes ``batch``, and its arrays (on the host
        or where they were): everything that can be wrong with a batch is found here."""
        if not isinstance(batch, Mapping):
            raise BindingError(
                f"A batch must be a dict of name -> array, got {type(batch).__name__}."
            )
        arrays: dict[str, Any] = {}
        for k, v in batch.items():
            if not hasattr(v, "shape") or not hasattr(v, "dtype"):
                v = np.asarray(v)
            arrays[k] = v
        rows = self.placement.process_count if local else 1
        chosen: Plan | None = None
        for plan in plans:
            sig = plan.batch_sig
            if len(sig) != len(arrays):
                continue
            ok = True
            for k, (shape, dt) in sig.items():
                a = arrays.get(k)
                if a is None or np.dtype(a.dtype) != dt:
                    ok = False
                    break
                got = tuple(a.shape)
                if rows != 1 and got:
                    got = (got[0] * rows, *got[1:])
                if got != shape:
                    ok = False
                    break
            if ok:
                chosen = plan
                break
        if chosen is None:
            raise BindingError(mismatch_message(entry, plans, arrays))
        if isinstance(chosen, RefusedPlan):  # replaces a None test; no slower
            raise BindingError(chosen.refusal)
        return chosen, arrays

    def transfer(
        self, chosen: CompiledPlan, arrays: Mapping[str, Any], local: bool = False
    ) -> dict[str, Any]:
        """Move a matched batch to the device (this process's rows, with ``local``)."""
        dev: dict[str, Any] = {}
        if local and self.placement.process_count != 1:
            for k in chosen.batch_sig:
                dev[k] = self.placement.put_local_batch(np.asarray(arrays[k]))
            return dev
        for k in chosen.batch_sig:
            dev[k] = self.to_device(arrays[k])
        return dev

    def to_device(self, a: Any) -> Any:
        if isinstance(a, np.ndarray):
            return self.placement.put_batch(a)
        # A device array: use it where it is when it already has the sharding needed.
        if self.placement.holds(a, split=a.ndim >= 1):
            return a
        if getattr(a, "is_fully_addressable", True) is False:
            # Gathering it would be a collective the other processes are not running.
            raise BindingError(
                "A batch array spread over other processes' devices must already have the "
                f"batch sharding ({self.placement.split}); pass numpy arrays instead, and "
                "every process copies its own rows."
            )
        return self.placement.put_batch(
            _compat.to_host(a) if hasattr(a, "sharding") else np.asarray(a)
        )


def mismatch_message(entry: str, plans: Sequence[Plan], arrays: Mapping[str, Any]) -> str:
    """Why ``arrays`` match none of ``plans`` (the shape buckets of ``entry``)."""
    got = (
        ", ".join(f"{k}: {describe(a.dtype, tuple(a.shape))}" for k, a in arrays.items())
        or "nothing"
    )
    expected = " | ".join(p.signature_text for p in plans)
    lines = [f"The batch does not match any shape bucket of the {entry!r} entry."]
    lines.append(f"  expected: {expected}")
    lines.append(f"  got:      {got}")
    names = set(plans[0].batch_sig)
    missing = sorted(names - set(arrays))
    extra = sorted(str(k) if isinstance(k, str) else repr(k) for k in set(arrays) - names)
    if any(not isinstance(k, str) for k in arrays):
        lines.append("Batch input names are strings: use the names the bundle lists above.")
    if missing:
        lines.append(f"Missing batch input(s): {', '.join(missing)}.")
    if extra:
        lines.append(f"Unexpected batch input(s): {', '.join(extra)}; remove them.")
    if not missing and not extra:
        for k, a in arrays.items():
            want = {
                (shape, dt) for p in plans for kk, (shape, dt) in p.batch_sig.items() if kk == k
            }
            if all(np.dtype(a.dtype) != dt for _, dt in want):
                dts = sorted({describe(dt, s) for s, dt in want})
                lines.append(
                    f"Dtype mismatch for batch input {k!r}: the bundle expects "
                    f"{' or '.join(dts)}, got {describe(a.dtype, tuple(a.shape))}. Cast the "
                    f"array, or re-export with a {np.dtype(a.dtype).name} example batch."
                )
            elif all(tuple(a.shape) != s for s, _ in want):
                lines.append(
                    f"Shape mismatch for batch input {k!r}: got {tuple(a.shape)}, the "
                    f"bundle has buckets {sorted({s for s, _ in want})}. Pad or split the "
                    "batch, or re-export with an example batch of this shape."
                )
    return "\n".join(lines)


def iter_batches(data: Mapping[str, np.ndarray[Any, Any]]) -> list[dict[str, np.ndarray[Any, Any]]]:
    """Split an npz-style dict of stacked arrays ``(S, *shape)`` into S batches."""
    sizes = {k: int(v.shape[0]) for k, v in data.items() if getattr(v, "ndim", 0) >= 1}
    if not data or len(sizes) != len(data) or len(set(sizes.values())) != 1:
        raise BindingError(
            "The data file must hold one array per batch input, each shaped (S, *batch "
            f"shape) with the same S; got { ({k: tuple(np.shape(v)) for k, v in data.items()}) }."
        )
    s = next(iter(sizes.values()))
    return [{k: np.asarray(v[i], order="C") for k, v in data.items()} for i in range(s)]
