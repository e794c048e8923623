"""``Manifest.matmul_precision`` (format 1.2): its default for older bundles, and refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from schema_helpers import data_area, pack, raw_bundle, wire_of, write_tiny

from stepbundle.schema import SchemaValidationError, open_bundle


def _bundle(tmp_path: Path, edit: Any, version: tuple[int, int]) -> Path:
    tiny = tmp_path / "tiny.sbnd"
    wire = wire_of(write_tiny(tiny))
    edit(wire)
    path = tmp_path / "edited.sbnd"
    path.write_bytes(raw_bundle(pack(wire), data_area(tiny.read_bytes()), version))
    return path


def test_a_1_1_bundle_without_the_field_reads_as_default(tmp_path: Path) -> None:
    path = _bundle(tmp_path, lambda w: w.pop("matmul_precision"), (1, 1))
    with open_bundle(path) as bundle:
        assert bundle.version == (1, 1)
        assert bundle.manifest.matmul_precision == "default"


@pytest.mark.parametrize("value", ["highest", "high", "default"])
def test_each_precision_round_trips(tmp_path: Path, value: str) -> None:
    path = _bundle(tmp_path, lambda w: w.__setitem__("matmul_precision", value), (1, 2))
    with open_bundle(path) as bundle:
        assert bundle.manifest.matmul_precision == value


@pytest.mark.parametrize("value", ["tf32", "HIGHEST", ""])
def test_an_unknown_precision_is_refused(tmp_path: Path, value: str) -> None:
    path = _bundle(tmp_path, lambda w: w.__setitem__("matmul_precision", value), (1, 2))
    with pytest.raises(SchemaValidationError, match="default, high, highest") as info:
        open_bundle(path)
    assert info.value.path == "matmul_precision"


@pytest.mark.parametrize("version", [(1, 1), (1, 2)])
@pytest.mark.parametrize("value", ["yolo", "PyTorch", "torch-xla"])
def test_an_unknown_numerics_is_refused(
    tmp_path: Path, value: str, version: tuple[int, int]
) -> None:
    """``numerics`` (1.1) is an enumeration the reader checks (issue #43, item 10): once,
    any non-empty string was accepted."""
    path = _bundle(tmp_path, lambda w: w.__setitem__("numerics", value), version)
    with pytest.raises(SchemaValidationError, match="pytorch, torch_xla") as info:
        open_bundle(path)
    assert info.value.path == "numerics"


@pytest.mark.parametrize("value", ["pytorch", "torch_xla", None])
def test_every_numerics_a_writer_wrote_is_read(tmp_path: Path, value: str | None) -> None:
    path = _bundle(tmp_path, lambda w: w.__setitem__("numerics", value), (1, 2))
    with open_bundle(path) as bundle:
        assert bundle.manifest.numerics == value


def test_a_newer_minor_may_record_a_numerics_this_reader_does_not_know(tmp_path: Path) -> None:
    path = _bundle(tmp_path, lambda w: w.__setitem__("numerics", "float64_reference"), (1, 99))
    with open_bundle(path) as bundle:
        assert bundle.manifest.numerics == "float64_reference"
