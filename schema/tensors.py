"""Tensor types of the bundle format: element dtypes and shapes (``TensorSpec``).

Part of the manifest's dataclasses (``manifest.py`` re-exports every name).

Imports: standard library only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["DType", "NamedSpec", "TensorSpec"]


class DType(str, enum.Enum):
    """Element type of a tensor. Values are the spellings used in the file."""

    F64 = "f64"
    F32 = "f32"
    BF16 = "bf16"
    F16 = "f16"
    I64 = "i64"
    I32 = "i32"
    I16 = "i16"
    I8 = "i8"
    U64 = "u64"
    U32 = "u32"
    U16 = "u16"
    U8 = "u8"
    BOOL = "bool"

    @property
    def itemsize(self) -> int:
        """Bytes per element in a tensor section (bool is one byte, 0 or 1)."""
        return _ITEMSIZE[self]


_ITEMSIZE: dict[DType, int] = {
    DType.F64: 8,
    DType.F32: 4,
    DType.BF16: 2,
    DType.F16: 2,
    DType.I64: 8,
    DType.I32: 4,
    DType.I16: 2,
    DType.I8: 1,
    DType.U64: 8,
    DType.U32: 4,
    DType.U16: 2,
    DType.U8: 1,
    DType.BOOL: 1,
}


@dataclass(frozen=True)
class TensorSpec:
    """Dtype and static shape of one tensor.

    Attributes:
      dtype: element type.
      shape: dimensions, outermost first; ``()`` is a scalar. Every dimension is >= 0.
    """

    dtype: DType
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar)."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in C order with no padding."""
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.value}[{','.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class NamedSpec:
    """A named tensor slot, used for the batch signature of a program.

    Attributes:
      name: the batch input's name, as in the recipe's example batch.
      spec: its dtype and shape.
    """

    name: str
    spec: TensorSpec
