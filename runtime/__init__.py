"""stepbundle.runtime: run a bundle's steps on any PJRT device, with no torch in the process.

``load(path, device, options=LoadOptions(...))`` returns a ``Trainer`` that owns the
training state on the device, donates it to every step and writes checkpoints PyTorch
loads back. Also here: ``to_floats`` (a step's metrics as numbers), ``write_dataset``
(arrays to a dataset folder ``Loader`` reads), ``set_cpu_devices`` (virtual CPU devices,
before jax starts) and ``ALLOWED_CUSTOM_CALLS`` (the native calls a program may make).

Modules: ``load.py`` (opening, compiling, placing) with ``options.py`` (what it is asked
to do) and ``devices.py`` (which devices); ``program.py`` (one program: ``validate.py``
checks it, ``rewrites.py`` rewrites it, ``compile_cache.py`` compiles it or finds it);
``trainer.py`` (the public trainer) composed of ``state_store.py`` (the state buffers),
``progress.py`` (steps, seed, data position), ``hyper.py`` (hyperparameters and
schedules), ``batches.py`` (shape buckets, batch refusals, data files), ``dispatch.py``
(the hot path), ``calls.py`` (K steps per call), ``runs.py`` (``run``'s loop) and
``checkpointing.py`` (checkpoint orchestration); ``load_info.py``, ``plan.py`` (compiled
and refused shape buckets), ``init_state.py`` (where the initial state comes from, and
placing it) with ``init_source.py`` (the checkpoint files it is read from) and
``tensor_file.py`` (mapped safetensors), ``state.py`` (named state <-> device buffers),
``checkpoint.py`` (the checkpoint file format), ``dtypes.py`` (the dtype table),
``fallback.py`` (slower paths taken, and why), ``store.py`` (bundles fetched from URLs,
kept by digest), ``remote.py`` (URLs, via fsspec).

Imports: numpy, jax/jaxlib, msgpack (through stepbundle.schema), fsspec (for URLs).
Never torch.
"""

from __future__ import annotations

from stepbundle.stablehlo.artifact import ALLOWED_CUSTOM_CALLS

from .checkpoint import CheckpointFormatError, OtherBundleError
from .compile_cache import CacheEvent, CacheOutcome, CacheWarning
from .dataset_writer import write_dataset
from .distributed import set_cpu_devices
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
from .metrics import to_floats
from .options import CompileOptions, LoadOptions, ParallelOptions, SafetyOptions, StateOptions
from .trainer import Trainer

__all__ = [
    "ALLOWED_CUSTOM_CALLS",
    "BindingError",
    "CacheEvent",
    "CacheOutcome",
    "CacheWarning",
    "CheckpointError",
    "CheckpointFormatError",
    "CompileOptions",
    "DeviceError",
    "InitStateError",
    "LoadInfo",
    "LoadOptions",
    "MissingStateError",
    "NonFiniteLossError",
    "OtherBundleError",
    "ParallelOptions",
    "PathChoice",
    "PathKind",
    "PlatformError",
    "SafetyOptions",
    "StateDtypeError",
    "StateOptions",
    "StateShapeError",
    "StepbundleFallbackWarning",
    "Trainer",
    "UnexpectedStateError",
    "load",
    "set_cpu_devices",
    "to_floats",
    "write_dataset",
]
