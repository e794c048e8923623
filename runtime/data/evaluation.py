"""Evaluation over a whole dataset: every row counted once, a padded last batch masked.

A bundle's read-only entry (``eval``) returns metrics that are means over the rows of its
batch (a mean loss, an accuracy). ``evaluate_dataset`` runs it over every batch and
averages each metric weighted by the number of real rows, so the result is the mean
over the dataset whatever the batch sizes.

A last batch shorter than the bundle's batch shapes has two ways through:
- a shape bucket of its own size (the loader's ``last_batch="keep"``), weighted by its
  rows; or
- padding (``last_batch="pad"`` with a ``mask_key``): the program cannot be told which
  rows are padding, so the padded batch is built again with every pad row a copy of the
  first real row ``r``, and one more batch of copies of ``r`` gives ``f(r)``, the value
  each pad row contributed. The real rows' mean is then
  ``(B * mean_padded - pads * f(r)) / real``, exact up to float rounding for metrics
  that are means over rows (per-row independent computations: eval-mode BatchNorm and
  dropout are). Metrics of another kind (a max over the batch, say) are not corrected;
  evaluate them with ``keep`` or a batch size that divides the dataset.

Imports: numpy, the trainer (through its public methods only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import BindingError

__all__ = ["Evaluation", "evaluate_dataset"]


class _Evaluates(Protocol):
    def evaluate(self, batch: Mapping[str, Any], entry: str = "eval") -> dict[str, Any]: ...


@dataclass(frozen=True)
class Evaluation:
    """The result of evaluating a dataset.

    Attributes:
      metrics: each scalar metric's mean over every real row.
      rows: the number of real rows evaluated.
      batches: the number of batches run (a padded last batch counts once).
    """

    metrics: dict[str, float]
    rows: int
    batches: int


def _rows(batch: Mapping[str, Any]) -> int:
    sizes = {int(np.shape(v)[0]) for v in batch.values() if np.ndim(v) >= 1}
    if len(sizes) != 1:
        raise BindingError(
            "Every input of an evaluation batch must have the same number of rows (its "
            f"first dimension); got {sorted(sizes)}."
        )
    return sizes.pop()


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        if a.size == 1:
            out[k] = float(a.reshape(()))
    return out


def _padded(
    batch: Mapping[str, np.ndarray[Any, Any]], mask: np.ndarray[Any, Any]
) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, np.ndarray[Any, Any]], int]:
    """The batch with its real rows first and every pad row a copy of the first real row,
    a batch of copies of that row, and the number of real rows."""
    real = np.flatnonzero(mask)
    if real.size == 0:
        raise BindingError("An evaluation batch's mask marks no row as real.")
    n = mask.shape[0]
    order = np.concatenate([real, np.full(n - real.size, real[0])])
    same = np.full(n, real[0])
    return (
        {k: np.asarray(v)[order] for k, v in batch.items()},
        {k: np.asarray(v)[same] for k, v in batch.items()},
        int(real.size),
    )


def evaluate_dataset(
    trainer: _Evaluates,
    batches: Iterable[Mapping[str, Any]],
    *,
    entry: str = "eval",
    mask_key: str | None = None,
) -> Evaluation:
    """Mean of each scalar metric of ``entry`` over every real row of ``batches``.

    Args:
      trainer: a ``Trainer`` (its ``evaluate`` runs the read-only entry; the state is
        never changed).
      batches: batches as dicts of arrays, e.g. a ``Loader`` with ``shuffle=False``.
      entry: a read-only entry of the bundle.
      mask_key: the key under which a batch carries its row mask (True for a real row),
        as a ``Loader(mask_key=...)`` delivers it; removed before the batch is run.

    Raises:
      BindingError: a batch matches no shape bucket, or ``batches`` is empty.
    """
    sums: dict[str, float] = {}
    rows = count = 0
    for raw in batches:
        batch = dict(raw)
        mask = (
            np.asarray(batch.pop(mask_key)) if mask_key is not None and mask_key in batch else None
        )
        if mask is not None and not mask.all():
            full, copies, real = _padded(batch, mask.astype(bool))
            n = mask.shape[0]
            padded = _scalars(trainer.evaluate(full, entry=entry))
            one = _scalars(trainer.evaluate(copies, entry=entry))
            means = {k: (n * v - (n - real) * one[k]) / real for k, v in padded.items()}
        else:
            real = _rows(batch)
            means = _scalars(trainer.evaluate(batch, entry=entry))
        for k, v in means.items():
            sums[k] = sums.get(k, 0.0) + v * real
        rows += real
        count += 1
    if rows == 0:
        raise BindingError("evaluate_dataset() got no batches: the dataset is empty.")
    return Evaluation({k: v / rows for k, v in sums.items()}, rows, count)
