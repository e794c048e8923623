"""The exporter's one torch -> bundle dtype table (stepbundle/exporter/dtypes.py)."""

from __future__ import annotations

import pytest
import torch

from stepbundle.exporter import ExportError
from stepbundle.frontend.dtypes import TORCH_DTYPES, dtype_of, spec_of, tensor_bytes
from stepbundle.schema.manifest import DType, TensorSpec


def test_every_bundle_dtype_has_exactly_one_torch_dtype() -> None:
    assert sorted(TORCH_DTYPES.values()) == sorted(DType)
    assert len(set(TORCH_DTYPES.values())) == len(TORCH_DTYPES)


def test_itemsizes_agree_with_the_schema() -> None:
    for torch_dtype, dtype in TORCH_DTYPES.items():
        assert torch.empty((), dtype=torch_dtype).element_size() == dtype.itemsize


def test_an_unsupported_dtype_is_refused_by_name() -> None:
    with pytest.raises(ExportError, match=r"State 'w' has dtype torch.complex64, which bundles"):
        dtype_of(torch.complex64, "State 'w'")


def test_spec_and_bytes() -> None:
    assert spec_of(torch.int32, (2, 3), "x") == TensorSpec(DType.I32, (2, 3))
    assert tensor_bytes(torch.tensor([True, False])) == b"\x01\x00"
    assert tensor_bytes(torch.tensor([1.0], dtype=torch.float32)) == b"\x00\x00\x80\x3f"
