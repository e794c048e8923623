"""stepbundle.runtime: run a bundle's steps on any PJRT device, with no torch in the process.

``load(path)`` returns a ``Trainer`` that owns the training state on the device,
donates it to every step and writes checkpoints PyTorch loads back.

Modules: ``load.py`` (opening, compiling, placing), ``trainer.py`` (the hot path and
checkpoint orchestration), ``plan.py`` (compiled and refused shape buckets),
``hyper.py`` (hyperparameters and schedules), ``batches.py`` (batch refusals, data
files), ``state.py`` (named state <-> device buffers), ``checkpoint.py`` (the checkpoint
file format), ``dtypes.py`` (the dtype table).

Imports: numpy, jax/jaxlib, msgpack (through stepbundle.schema). Never torch.
"""

from __future__ import annotations

from .checkpoint import CheckpointFormatError, OtherBundleError
from .errors import BindingError, CheckpointError, NonFiniteLossError, PlatformError
from .load import load
from .trainer import Trainer

__all__ = [
    "BindingError",
    "CheckpointError",
    "CheckpointFormatError",
    "NonFiniteLossError",
    "OtherBundleError",
    "PlatformError",
    "Trainer",
    "load",
]
