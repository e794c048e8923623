"""stepbundle.runtime: run a bundle's steps on any PJRT device, with no torch in the process.

``load(path)`` returns a ``Trainer`` that owns the training state on the device,
donates it to every step and writes checkpoints PyTorch loads back.

Imports: numpy, jax/jaxlib, msgpack (through stepbundle.schema). Never torch.
"""

from __future__ import annotations

from .errors import BindingError, CheckpointError, NonFiniteLossError, PlatformError
from .load import load
from .trainer import Trainer, advance_seed

__all__ = [
    "BindingError",
    "CheckpointError",
    "NonFiniteLossError",
    "PlatformError",
    "Trainer",
    "advance_seed",
    "load",
]
