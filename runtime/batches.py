"""Batches: what is wrong with a batch no shape bucket takes, and data files as batches.

``mismatch_message`` explains, in whole sentences, why a batch matches none of an
entry's shape buckets (the trainer calls it only once a batch was refused, never on the
hot path). ``iter_batches`` splits an npz-style dict of stacked arrays into batches.

Imports: numpy, stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .dtypes import describe
from .errors import BindingError
from .plan import Plan

__all__ = ["iter_batches", "mismatch_message"]


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
