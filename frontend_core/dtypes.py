"""The exporter's one table from torch dtypes to bundle dtypes, and the bytes of a tensor.

Imports: torch, stepbundle.schema.
"""

from __future__ import annotations

import sys

import torch

from stepbundle.schema.manifest import DType, TensorSpec

from .errors import ExportError

__all__ = ["HYPERPARAMETER_DTYPE", "TORCH_DTYPES", "dtype_of", "spec_of", "tensor_bytes"]

TORCH_DTYPES: dict[torch.dtype, DType] = {
    torch.float64: DType.F64,
    torch.float32: DType.F32,
    torch.bfloat16: DType.BF16,
    torch.float16: DType.F16,
    torch.int64: DType.I64,
    torch.int32: DType.I32,
    torch.int16: DType.I16,
    torch.int8: DType.I8,
    torch.uint64: DType.U64,
    torch.uint32: DType.U32,
    torch.uint16: DType.U16,
    torch.uint8: DType.U8,
    torch.bool: DType.BOOL,
}
"""Every torch dtype a bundle can hold, and its bundle dtype (one per ``DType``)."""

HYPERPARAMETER_DTYPE: torch.dtype = torch.float32
"""The dtype of every declared hyperparameter's device tensor and bundle input."""


def dtype_of(dtype: torch.dtype, what: str) -> DType:
    """The bundle dtype of a torch dtype; ``what`` names the tensor in the error."""
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise ExportError(
            f"{what} has dtype {dtype}, which bundles cannot hold (supported: "
            f"{', '.join(str(d) for d in TORCH_DTYPES)}). Cast it to a supported dtype."
        ) from None


def spec_of(dtype: torch.dtype, shape: tuple[int, ...], what: str) -> TensorSpec:
    """The bundle's ``TensorSpec`` of a torch dtype and shape."""
    return TensorSpec(dtype_of(dtype, what), tuple(int(d) for d in shape))


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Little-endian, C-order bytes of a tensor (the layout of tensor sections)."""
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        raise ExportError("The exporter runs on little-endian hosts only.")
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()
