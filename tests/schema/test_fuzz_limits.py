"""Hostile sizes and counts: the reader allocates what the file holds, in time linear in it.

A manifest can name any size. The reader must refuse sizes the file cannot hold before it
allocates anything (measured here with tracemalloc), and its cost must grow with the sum
of the manifest's tables, never their product: a 40 MB manifest with 100,000 programs and
100,000 state entries must not keep a reader busy for hours. The costs are counted as
executed lines of stepbundle.schema, not timed, so the tests are exact and fast.
"""

from __future__ import annotations

import hashlib
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from schema_helpers import data_area, pack, raw_bundle, wire_of, write_tiny

import stepbundle.schema
from stepbundle.schema import (
    BundleFormatError,
    DType,
    Entry,
    Manifest,
    NamedSpec,
    Producer,
    Program,
    SchemaValidationError,
    Section,
    SectionKind,
    SectionPayload,
    StateEntry,
    StateKind,
    TensorSpec,
    open_bundle,
    validate,
    write_bundle,
)
from stepbundle.schema.layout import HEADER_SIZE, align
from stepbundle.schema.wire import encode_manifest

SCHEMA_DIR = str(Path(stepbundle.schema.__file__).resolve().parent)

# Far more than the reader needs for the tiny bundle's manifest, far less than any size
# a manifest below names.
SMALL = 1024 * 1024


@contextmanager
def peak_allocation() -> Iterator[list[int]]:
    """Measure the peak of Python and numpy allocations inside the block."""
    result: list[int] = []
    tracemalloc.start()
    try:
        yield result
    finally:
        result.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def _with_wire(tmp_path: Path, edit: Callable[[Any], None]) -> Path:
    """The tiny bundle with its manifest edited, its digest recomputed, the same data."""
    tiny = tmp_path / "tiny.sbnd"
    write_tiny(tiny)
    wire = wire_of(tiny_manifest_with_sections(tiny))
    edit(wire)
    path = tmp_path / "hostile.sbnd"
    path.write_bytes(raw_bundle(pack(wire), data_area(tiny.read_bytes())))
    return path


def tiny_manifest_with_sections(path: Path) -> Manifest:
    with open_bundle(path) as bundle:
        return bundle.manifest


def _set_w_shape(wire: Any, shape: list[int]) -> None:
    """Give state 'w' a new shape everywhere it is named, so that only sizes disagree."""
    wire["state"][0]["spec"]["shape"] = shape
    program = wire["entries"]["train"]["programs"][0]
    program["inputs"][0]["spec"]["shape"] = shape
    program["outputs"][1]["spec"]["shape"] = shape


@pytest.mark.parametrize("nbytes", [2**34, 2**60, 2**63 - 64])
def test_a_huge_tensor_section_is_refused_before_anything_is_allocated(
    tmp_path: Path, nbytes: int
) -> None:
    def edit(wire: Any) -> None:
        _set_w_shape(wire, [nbytes // 4])
        wire["sections"][1]["length"] = nbytes  # 'state.w', the last section

    path = _with_wire(tmp_path, edit)
    with peak_allocation() as peak, pytest.raises(BundleFormatError) as info:
        open_bundle(path)
    assert "truncated: section 'state.w' needs" in str(info.value)
    assert peak[0] < SMALL


@pytest.mark.parametrize("offset", [2**34, 2**60])
def test_a_section_far_past_the_end_is_refused_without_allocating(
    tmp_path: Path, offset: int
) -> None:
    path = _with_wire(tmp_path, lambda w: w["sections"][1].update(offset=offset))
    with peak_allocation() as peak, pytest.raises(BundleFormatError, match="truncated"):
        open_bundle(path)
    assert peak[0] < SMALL


def test_a_huge_shape_over_a_small_section_is_a_size_mismatch(tmp_path: Path) -> None:
    path = _with_wire(tmp_path, lambda w: _set_w_shape(w, [2**30, 2**28]))
    with peak_allocation() as peak, pytest.raises(SchemaValidationError) as info:
        open_bundle(path)
    assert info.value.path == "state[0].section"
    assert f"({2**60} bytes)" in str(info.value)  # computed, never allocated
    assert peak[0] < SMALL


def test_a_shape_whose_size_overflows_int64_is_refused(tmp_path: Path) -> None:
    path = _with_wire(tmp_path, lambda w: _set_w_shape(w, [2**62, 2**62]))
    with peak_allocation() as peak, pytest.raises(SchemaValidationError, match="2\\*\\*63"):
        open_bundle(path)
    assert peak[0] < SMALL


@pytest.mark.parametrize(
    "manifest",
    [
        b"\xdd\xff\xff\xff\xff",  # an array of 2**32 - 1 elements
        b"\xdf\xff\xff\xff\xff",  # a map of 2**32 - 1 pairs
        b"\xdb\xff\xff\xff\xff",  # a string of 2**32 - 1 bytes
        b"\xc6\xff\xff\xff\xff",  # binary data of 2**32 - 1 bytes
        b"\x91" * 100_000,  # arrays nested 100,000 deep
    ],
    ids=["array", "map", "str", "bin", "deep"],
)
def test_msgpack_lengths_beyond_the_manifest_are_refused(tmp_path: Path, manifest: bytes) -> None:
    path = tmp_path / "hostile.sbnd"
    path.write_bytes(raw_bundle(manifest, b""))
    with peak_allocation() as peak, pytest.raises(BundleFormatError, match="not valid msgpack"):
        open_bundle(path)
    assert peak[0] < SMALL


# -- costs linear in the manifest ---------------------------------------------------------


@contextmanager
def schema_lines() -> Iterator[list[int]]:
    """Count the lines of stepbundle.schema executed inside the block (loop iterations
    included), a measure of work that does not depend on the machine."""
    count = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            count[0] += 1
        return local

    def global_(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(SCHEMA_DIR) else None

    previous = sys.gettrace()
    sys.settrace(global_)
    try:
        yield count
    finally:
        sys.settrace(previous)


_EMPTY = hashlib.sha256(b"").hexdigest()


def _wide_manifest(n: int) -> Manifest:
    """n state entries and n programs (empty sections, distinct batch signatures)."""
    empty = TensorSpec(DType.F32, (0,))
    sections = [Section(f"t{i}", SectionKind.TENSOR, 0, 0, _EMPTY) for i in range(n)]
    sections += [Section(f"p{i}", SectionKind.PROGRAM, 0, 0, _EMPTY) for i in range(n)]
    state = tuple(
        StateEntry(f"w{i}", StateKind.PARAMETER, empty, f"t{i}", trainable=True) for i in range(n)
    )
    programs = tuple(
        Program(f"p{i}", "1.0.0", (), (), (NamedSpec("x", TensorSpec(DType.F32, (i,))),))
        for i in range(n)
    )
    return Manifest(
        producer=Producer("0.1.0", "2.9.0", "2.9.0", "0.7.1"),
        entries={"train": Entry(programs, updates_state=True)},
        state=state,
        hyperparameters=(),
        rng=None,
        sections=tuple(sections),
    )


def _validate_lines(n: int) -> int:
    manifest = _wide_manifest(n)
    length = len(encode_manifest(manifest))
    with schema_lines() as lines:
        validate(manifest, align(HEADER_SIZE + length), manifest_length=length)
    return lines[0]


def test_validation_cost_grows_with_the_sum_of_programs_and_states() -> None:
    # Quadrupling both tables must cost about four times the work, not sixteen.
    small, large = _validate_lines(150), _validate_lines(600)
    assert large < 6 * small, (small, large)


def _lookup_lines(tmp_path: Path, n: int) -> int:
    manifest = _wide_manifest(n)
    path = tmp_path / f"wide{n}.sbnd"
    write_bundle(path, manifest, [SectionPayload(s.name, s.kind, b"") for s in manifest.sections])
    with open_bundle(path) as bundle, schema_lines() as lines:
        for section in bundle.manifest.sections:
            bundle.section(section.name)
    return lines[0]


def test_section_lookup_cost_does_not_grow_with_the_section_count(tmp_path: Path) -> None:
    # A runtime reads every state tensor's section: n lookups must cost O(n), not O(n**2).
    small, large = _lookup_lines(tmp_path, 150), _lookup_lines(tmp_path, 600)
    assert large < 6 * small, (small, large)
