"""The trainer and its parts: ``trainer`` (the public ``Trainer``) composed of
``state_store`` (the state buffers), ``progress`` (steps, seed, data position), ``hyper``
and ``schedule`` (hyperparameters and their schedules), ``plan`` and ``batches`` (shape
buckets and batch refusals), ``dispatch`` (the hot path), ``calls`` (K steps per call),
``runs`` (``run``'s loop), ``watch`` (non-finite refusals), ``checkpointing`` (saving and
restoring) and ``metrics`` (a step's metrics as numbers).

May import: the base modules and every other room (``io``, ``placement``, ``data``,
``compile``, ``state``).
"""

from __future__ import annotations

from .metrics import to_floats
from .schedule import parse_schedule
from .trainer import Trainer

__all__ = ["Trainer", "parse_schedule", "to_floats"]
