"""stepbundle.runtime: run a bundle's steps on any PJRT device, with no torch in the process.

``load(path)`` returns a ``Trainer`` that owns the training state on the device,
donates it to every step and writes checkpoints PyTorch loads back.

Modules: ``load.py`` (opening, compiling, placing), ``trainer.py`` (the hot path),
``checkpointing.py`` (state access and checkpoint orchestration), ``load_info.py``, ``plan.py`` (compiled and refused shape buckets),
``init_state.py`` (where the initial state comes from, and placing it) with ``init_source.py``
(the checkpoint files it is read from) and ``tensor_file.py`` (mapped safetensors),
``hyper.py`` (hyperparameters and schedules), ``batches.py`` (batch refusals, data
files), ``state.py`` (named state <-> device buffers), ``checkpoint.py`` (the checkpoint
file format), ``dtypes.py`` (the dtype table), ``fallback.py`` (slower paths taken, and why),
``store.py`` (bundles fetched from URLs, kept by digest), ``remote.py`` (URLs, via fsspec).

Imports: numpy, jax/jaxlib, msgpack (through stepbundle.schema), fsspec (for URLs).
Never torch.
"""

from __future__ import annotations

from .checkpoint import CheckpointFormatError, OtherBundleError
from .errors import BindingError, CheckpointError, DeviceError, NonFiniteLossError, PlatformError
from .fallback import PathChoice, PathKind, StepbundleFallbackWarning
from .init_state import (
    InitStateError,
    MissingStateError,
    StateDtypeError,
    StateShapeError,
    UnexpectedStateError,
)
from .load import load
from .load_info import LoadInfo
from .program import CacheEvent, CacheOutcome, CacheWarning
from .trainer import Trainer

__all__ = [
    "BindingError",
    "CacheEvent",
    "CacheOutcome",
    "CacheWarning",
    "CheckpointError",
    "CheckpointFormatError",
    "DeviceError",
    "InitStateError",
    "LoadInfo",
    "MissingStateError",
    "NonFiniteLossError",
    "OtherBundleError",
    "PathChoice",
    "PathKind",
    "PlatformError",
    "StateDtypeError",
    "StateShapeError",
    "StepbundleFallbackWarning",
    "Trainer",
    "UnexpectedStateError",
    "load",
]
