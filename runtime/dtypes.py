"""The bundle's dtypes as numpy dtypes (bf16 through ml_dtypes, which jax depends on).

Imports: numpy, ml_dtypes, stepbundle.schema.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from stepbundle.schema.manifest import DType, TensorSpec

__all__ = ["NUMPY_DTYPES", "describe", "from_numpy", "to_numpy"]

NUMPY_DTYPES: dict[DType, np.dtype[Any]] = {
    DType.F64: np.dtype(np.float64),
    DType.F32: np.dtype(np.float32),
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.F16: np.dtype(np.float16),
    DType.I64: np.dtype(np.int64),
    DType.I32: np.dtype(np.int32),
    DType.I16: np.dtype(np.int16),
    DType.I8: np.dtype(np.int8),
    DType.U64: np.dtype(np.uint64),
    DType.U32: np.dtype(np.uint32),
    DType.U16: np.dtype(np.uint16),
    DType.U8: np.dtype(np.uint8),
    DType.BOOL: np.dtype(np.bool_),
}
_FROM_NUMPY = {v: k for k, v in NUMPY_DTYPES.items()}


def to_numpy(dtype: DType) -> np.dtype[Any]:
    return NUMPY_DTYPES[dtype]


def from_numpy(dtype: np.dtype[Any]) -> DType | None:
    return _FROM_NUMPY.get(np.dtype(dtype))


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
