"""State entries without stored values (format 1.1): ``fill`` and ``external`` sections."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from schema_helpers import PROGRAM_BYTES, spec, tiny_manifest

from stepbundle.schema import (
    STATE_INITIALIZERS,
    ConstantInput,
    DType,
    Entry,
    SchemaValidationError,
    SectionKind,
    SectionPayload,
    StateEntry,
    StateKind,
    UnsupportedVersionError,
    open_bundle,
    version,
    write_bundle,
)

ZERO_F32 = bytes(4)


def _manifest(features: tuple[str, ...] = (STATE_INITIALIZERS,)) -> object:
    """The tiny manifest with its weight external and a zero-filled moment beside it."""
    m = tiny_manifest()
    w = m.state[0]
    moment = StateEntry(
        name="optimizer.state.w.exp_avg",
        kind=StateKind.OPTIMIZER_STATE,
        spec=w.spec,
        section="state.m",
        trainable=False,
    )
    return dataclasses.replace(m, state=(w, moment), required_features=features)


def _payloads(w: bytes = b"", m: bytes = ZERO_F32) -> list[SectionPayload]:
    return [
        SectionPayload("train.program", SectionKind.PROGRAM, PROGRAM_BYTES),
        SectionPayload("state.w", SectionKind.EXTERNAL, w),
        SectionPayload("state.m", SectionKind.FILL, m),
    ]


def test_fill_and_external_sections_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "free.sbnd"
    written = write_bundle(path, _manifest(), _payloads())
    with open_bundle(path) as b:
        assert b.manifest == written
        assert b.manifest.required_features == ("state_initializers",)
        kinds = {s.name: (s.kind, s.length) for s in b.manifest.sections}
        assert kinds["state.w"] == (SectionKind.EXTERNAL, 0)
        assert kinds["state.m"] == (SectionKind.FILL, 4)
        assert bytes(b.section("state.m")) == ZERO_F32
        assert b.verify() == []
    # An external section takes no room: the next section starts where it would have.
    sections = written.sections
    assert sections[1].offset == sections[2].offset == 64


def test_a_bundle_using_them_must_require_the_feature(tmp_path: Path) -> None:
    with pytest.raises(SchemaValidationError, match="state_initializers") as e:
        write_bundle(tmp_path / "x.sbnd", _manifest(features=()), _payloads())
    assert "state 'w' names the external section 'state.w'" in str(e.value)
    assert not (tmp_path / "x.sbnd").exists()


@pytest.mark.parametrize(
    ("w", "m", "message"),
    [
        (b"", bytes(8), "holds one element (4 bytes), but it has 8 bytes"),
        (b"", b"", "holds one element (4 bytes), but it has 0 bytes"),
        (bytes(16), ZERO_F32, "holds no bytes, but it has 16 bytes"),
    ],
)
def test_section_lengths_are_checked(tmp_path: Path, w: bytes, m: bytes, message: str) -> None:
    with pytest.raises(SchemaValidationError, match=re.escape(message)):
        write_bundle(tmp_path / "x.sbnd", _manifest(), _payloads(w, m))


def test_a_constant_cannot_be_a_fill(tmp_path: Path) -> None:
    m = _manifest()
    program = m.entries["train"].programs[0]
    constant = ConstantInput("c", spec(DType.F32, 2, 2), "state.m")
    program = dataclasses.replace(program, inputs=(*program.inputs, constant))
    m = dataclasses.replace(m, entries={"train": Entry((program,), True)})
    with pytest.raises(SchemaValidationError, match="a fill section, not tensor"):
        write_bundle(tmp_path / "x.sbnd", m, _payloads())


def test_a_reader_without_the_feature_refuses_such_bundles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "free.sbnd"
    write_bundle(path, _manifest(), _payloads())
    monkeypatch.setattr(version, "KNOWN_FEATURES", frozenset())  # a 1.0 reader
    with pytest.raises(UnsupportedVersionError, match="'state_initializers'") as e:
        open_bundle(path)
    assert e.value.missing_features == ("state_initializers",)
    assert "Upgrade stepbundle" in str(e.value)
