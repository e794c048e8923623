"""FORMAT.md states the constants the code uses."""

from __future__ import annotations

from pathlib import Path

import stepbundle.schema as schema
from stepbundle.schema import DType, InputKind, OutputKind, SectionKind, StateKind
from stepbundle.schema.layout import ALIGNMENT, HEADER_FORMAT, HEADER_SIZE, MAGIC
from stepbundle.schema.limits import MAX_MANIFEST_BYTES, MAX_RANK, MAX_SECTIONS
from stepbundle.schema.validate import PLATFORMS
from stepbundle.schema.version import FORMAT_VERSION

FORMAT_MD = Path(schema.__file__).with_name("FORMAT.md")


def _text() -> str:
    return FORMAT_MD.read_text(encoding="utf-8")


def test_format_md_states_the_container_constants() -> None:
    text = _text()
    assert MAGIC.hex(" ") in text  # 89 53 42 4e 44 4c 0d 0a
    assert f"HEADER_SIZE = {HEADER_SIZE}" in text and HEADER_SIZE == 64
    assert f"ALIGNMENT = {ALIGNMENT}" in text and ALIGNMENT == 64
    assert f"struct `{HEADER_FORMAT}`" in text
    assert f"MAX_MANIFEST_BYTES = {MAX_MANIFEST_BYTES}" in text
    assert f"at most {MAX_SECTIONS} sections" in text
    assert f"rank at most {MAX_RANK}" in text


def test_format_md_states_the_version() -> None:
    text = _text()
    major, minor = FORMAT_VERSION
    assert text.splitlines()[0] == f"# The stepbundle file format, version {major}.{minor}"
    assert f"| 8-9   | u16      | major version   | {major}" in text
    assert f"| 10-11 | u16      | minor version   | {minor}" in text


def test_format_md_states_the_rng_rule() -> None:
    text = _text()
    assert "next = (1012031 + seed * 7012063) mod 2^64" in text
    assert "int64 with the same 64 bits" in text


def test_format_md_lists_every_enum_value() -> None:
    text = _text()
    for enum_type in (DType, SectionKind, StateKind, InputKind, OutputKind):
        for member in enum_type:
            assert f"`{member.value}`" in text or f"| {member.value} " in text, member
    for dtype in DType:
        assert f"| {dtype.value:<5} | {dtype.itemsize:<5} |" in text, dtype
    for platform in PLATFORMS:
        assert f"`{platform}`" in text
