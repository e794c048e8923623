"""stepbundle.runtime: run a bundle's steps on any PJRT device, with no torch in the process.

``load(path, device, options=LoadOptions(...))`` returns a ``Trainer`` that owns the
training state on the device, donates it to every step and writes checkpoints PyTorch
loads back. Also here: ``to_floats`` (a step's metrics as numbers), ``write_dataset``
(arrays to a dataset folder ``Loader`` reads), ``set_cpu_devices`` (virtual CPU devices,
before jax starts) and ``ALLOWED_CUSTOM_CALLS`` (the native calls a program may make).

Rooms, lowest first; a room imports only the base modules and the rooms before it
(``tests/test_layering.py`` holds the order):

- base modules here: ``errors`` (the error types), ``dtypes`` (the dtype table),
  ``fallback`` (slower paths taken, and why), ``_compat`` (every jaxlib spelling that
  differs between the versions supported);
- ``io/``: URLs, the bundle store, mapped safetensors files;
- ``placement/``: devices, processes, shardings, packed state buffers;
- ``data/``: dataset folders, their writer and loader, whole-dataset evaluation;
- ``compile/``: program checks, rewrites, the compile cache, the allocator setting;
- ``state/``: named state, the initial state's sources, the checkpoint format;
- ``train/``: the ``Trainer`` and its parts;
- the face, here: ``load.py`` (opening, compiling, placing) and ``options.py`` (what it
  is asked to do).

Imports: numpy, jax/jaxlib, msgpack (through stepbundle.schema), fsspec (for URLs).
Never torch.
"""

from __future__ import annotations

from stepbundle.stablehlo.artifact import ALLOWED_CUSTOM_CALLS

from .compile.compile_cache import CacheEvent, CacheOutcome, CacheWarning
from .compile.load_info import LoadInfo
from .data.dataset_writer import write_dataset
from .errors import (
    BindingError,
    BundleError,
    CheckpointError,
    DataError,
    DeviceError,
    NonFiniteLossError,
    PlatformError,
    StepbundleError,
    UsageError,
)
from .fallback import PathChoice, PathKind, StepbundleFallbackWarning
from .io.store import BundleNotFoundError
from .load import load
from .options import CompileOptions, LoadOptions, ParallelOptions, SafetyOptions, StateOptions
from .placement.distributed import set_cpu_devices
from .placement.layout_spec import LayoutError, ShardRule
from .state.checkpoint import OtherBundleError
from .state.init_state import InitStateError
from .train.metrics import to_floats
from .train.trainer import Trainer

__all__ = [
    "ALLOWED_CUSTOM_CALLS",
    "BindingError",
    "BundleError",
    "BundleNotFoundError",
    "CacheEvent",
    "CacheOutcome",
    "CacheWarning",
    "CheckpointError",
    "CompileOptions",
    "DataError",
    "DeviceError",
    "InitStateError",
    "LayoutError",
    "LoadInfo",
    "LoadOptions",
    "NonFiniteLossError",
    "OtherBundleError",
    "ParallelOptions",
    "PathChoice",
    "PathKind",
    "PlatformError",
    "SafetyOptions",
    "ShardRule",
    "StateOptions",
    "StepbundleError",
    "StepbundleFallbackWarning",
    "Trainer",
    "UsageError",
    "load",
    "set_cpu_devices",
    "to_floats",
    "write_dataset",
]
