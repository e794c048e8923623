"""The bundle's dtypes as numpy dtypes and as safetensors codes: the runtime's one table.

Every DType <-> numpy and DType <-> safetensors mapping in the runtime goes through
the table below (one row per dtype) and the two inverse maps derived from it, so a new
dtype is one new row. bf16 comes from ml_dtypes, which jax depends on.

Imports: numpy, ml_dtypes, stepbundle.schema.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from stepbundle.schema.manifest import DType, TensorSpec

__all__ = [
    "NUMPY_DTYPES",
    "SAFETENSORS_CODES",
    "describe",
    "from_numpy",
    "from_safetensors",
    "to_numpy",
]

# DType -> (numpy dtype, safetensors dtype code).
_TABLE: dict[DType, tuple[np.dtype[Any], str]] = {
    DType.F64: (np.dtype(np.float64), "F64"),
    DType.F32: (np.dtype(np.float32), "F32"),
    DType.BF16: (np.dtype(ml_dtypes.bfloat16), "BF16"),
    DType.F16: (np.dtype(np.float16), "F16"),
    DType.I64: (np.dtype(np.int64), "I64"),
    DType.I32: (np.dtype(np.int32), "I32"),
    DType.I16: (np.dtype(np.int16), "I16"),
    DType.I8: (np.dtype(np.int8), "I8"),
    DType.U64: (np.dtype(np.uint64), "U64"),
    DType.U32: (np.dtype(np.uint32), "U32"),
    DType.U16: (np.dtype(np.uint16), "U16"),
    DType.U8: (np.dtype(np.uint8), "U8"),
    DType.BOOL: (np.dtype(np.bool_), "BOOL"),
}

NUMPY_DTYPES: dict[DType, np.dtype[Any]] = {d: row[0] for d, row in _TABLE.items()}
SAFETENSORS_CODES: dict[DType, str] = {d: row[1] for d, row in _TABLE.items()}
_FROM_NUMPY: dict[np.dtype[Any], DType] = {v: k for k, v in NUMPY_DTYPES.items()}
_FROM_SAFETENSORS: dict[str, DType] = {v: k for k, v in SAFETENSORS_CODES.items()}


def to_numpy(dtype: DType) -> np.dtype[Any]:
    return NUMPY_DTYPES[dtype]


def from_numpy(dtype: np.dtype[Any]) -> DType | None:
    """The bundle dtype of a numpy dtype; None for one bundles cannot hold."""
    return _FROM_NUMPY.get(np.dtype(dtype))


def from_safetensors(code: str) -> DType | None:
    """The bundle dtype of a safetensors dtype code ("F32"); None for an unknown code."""
    return _FROM_SAFETENSORS.get(code)


def describe(dtype: Any, shape: tuple[int, ...]) -> str:
    """``float32[32,16]``-style text for an array's dtype and shape."""
    d = from_numpy(np.dtype(dtype))
    name = d.value if d is not None else str(dtype)
    return f"{name}[{','.join(str(int(s)) for s in shape)}]"


def array_from_section(data: memoryview, spec: TensorSpec) -> np.ndarray[Any, Any]:
    """A numpy array of a tensor section (little-endian, C order); large ones are views."""
    # Sections are little-endian; every platform the runtime supports is too.
    dt = NUMPY_DTYPES[spec.dtype]
    view = np.frombuffer(data, dtype=dt, count=spec.numel).reshape(spec.shape)
    # Small tensors are copied: the device transfer of a small host array may keep the
    # array (and with it the whole file mapping) alive after loading.
    return view.copy() if view.nbytes <= 65536 else view
