"""The training state as named tensors: between PyTorch's names and device buffers
(``named``), where a run's initial state comes from (``init_state``, ``init_source``) and
the checkpoint file format (``checkpoint``).

May import: the base modules, ``io`` and ``placement``.
"""

from __future__ import annotations

from .checkpoint import OtherBundleError, read_checkpoint, write_checkpoint
from .init_state import InitPlan, InitStateError, place_state, plan_initial_state

__all__ = [
    "InitPlan",
    "InitStateError",
    "OtherBundleError",
    "place_state",
    "plan_initial_state",
    "read_checkpoint",
    "write_checkpoint",
]
