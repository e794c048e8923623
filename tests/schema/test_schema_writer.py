"""write_bundle is deterministic and atomic; Bundle hands out zero-copy, checked sections."""

from __future__ import annotations

import array
import dataclasses
import hashlib
import os
from pathlib import Path

import pytest
from schema_helpers import PROGRAM_BYTES, WEIGHT_BYTES, tiny_manifest, tiny_payloads, write_tiny

from stepbundle.schema import (
    BundleError,
    DType,
    IntegrityError,
    SectionKind,
    SectionPayload,
    StateEntry,
    StateKind,
    TensorSpec,
    atomic,
    open_bundle,
    read_manifest,
    write_bundle,
)
from stepbundle.schema.wire import encode_manifest


def test_same_inputs_give_identical_files(tmp_path: Path) -> None:
    a, b = tmp_path / "a.sbnd", tmp_path / "sub" / "b.sbnd"
    b.parent.mkdir()
    first = write_tiny(a)
    second = write_tiny(b)
    assert first == second
    assert a.read_bytes() == b.read_bytes()
    # Equal manifests whose entries were inserted in another order encode the same.
    m = tiny_manifest()
    train = m.entries["train"]
    m2 = dataclasses.replace(m, entries={"eval": train, "train": train})
    m3 = dataclasses.replace(m, entries={"train": train, "eval": train})
    assert m2 == m3
    assert encode_manifest(m2) == encode_manifest(m3)


def test_returned_manifest_has_the_sections(tmp_path: Path) -> None:
    final = write_tiny(tmp_path / "a.sbnd")
    assert [(s.name, s.kind, s.offset, s.length) for s in final.sections] == [
        ("train.program", SectionKind.PROGRAM, 0, len(PROGRAM_BYTES)),
        ("state.w", SectionKind.TENSOR, 64, 16),
    ]
    assert final.sections[1].sha256 == hashlib.sha256(WEIGHT_BYTES).hexdigest()
    assert read_manifest(tmp_path / "a.sbnd") == final


class _FlakyPayload:
    """Looks like a SectionPayload; its data can be read once, then access fails."""

    def __init__(self, name: str, kind: SectionKind, data: bytes) -> None:
        self.name, self.kind, self._data, self.reads = name, kind, data, 0

    @property
    def data(self) -> bytes:
        self.reads += 1
        if self.reads > 1:
            raise RuntimeError("the device buffer went away")
        return self._data


def test_failed_write_leaves_no_temp_file_and_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "model.sbnd"
    target.write_bytes(b"the previous bundle")
    payloads = [
        SectionPayload("train.program", SectionKind.PROGRAM, PROGRAM_BYTES),
        _FlakyPayload("state.w", SectionKind.TENSOR, WEIGHT_BYTES),
    ]
    with pytest.raises(RuntimeError, match="went away"):
        write_bundle(target, tiny_manifest(), payloads)  # type: ignore[arg-type]
    assert payloads[1].reads == 2  # it failed while writing, after the first section
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.sbnd"]
    assert target.read_bytes() == b"the previous bundle"


def test_failure_at_fsync_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "model.sbnd"
    target.write_bytes(b"old")

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space left"):
        write_tiny(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.sbnd"]
    assert target.read_bytes() == b"old"


def test_payload_changed_during_write_is_refused(tmp_path: Path) -> None:
    data = bytearray(WEIGHT_BYTES)

    class Mutating(_FlakyPayload):
        @property
        def data(self) -> bytearray:  # type: ignore[override]
            self.reads += 1
            if self.reads == 2:
                data[0] ^= 1  # a buffer modified between layout and write
            return data

    payloads = [
        SectionPayload("train.program", SectionKind.PROGRAM, PROGRAM_BYTES),
        Mutating("state.w", SectionKind.TENSOR, b""),
    ]
    with pytest.raises(IntegrityError, match="'state.w' changed while"):
        write_bundle(tmp_path / "m.sbnd", tiny_manifest(), payloads)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_temp_file_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        seen.append(os.path.basename(src))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_tiny(tmp_path / "model.sbnd")
    assert len(seen) == 1
    assert seen[0].startswith(f".model.sbnd.tmp-{atomic._HOST}-{os.getpid()}-")


def test_any_buffer_is_accepted(tmp_path: Path) -> None:
    floats = array.array("f", [1.0, 2.0, 3.0, 4.0])  # a non-byte buffer, like a numpy array
    m = dataclasses.replace(
        tiny_manifest(),
        state=(
            StateEntry("w", StateKind.PARAMETER, TensorSpec(DType.F32, (2, 2)), "state.w", True),
        ),
    )
    payloads = [
        SectionPayload("train.program", SectionKind.PROGRAM, memoryview(PROGRAM_BYTES)),
        SectionPayload("state.w", SectionKind.TENSOR, floats),  # type: ignore[arg-type]
    ]
    write_bundle(tmp_path / "a.sbnd", m, payloads)
    with open_bundle(tmp_path / "a.sbnd") as bundle:
        assert bytes(bundle.section("state.w")) == floats.tobytes()


def test_non_contiguous_buffer_is_refused(tmp_path: Path) -> None:
    payloads = [
        SectionPayload("train.program", SectionKind.PROGRAM, memoryview(PROGRAM_BYTES)[::2]),
        tiny_payloads()[1],
    ]
    with pytest.raises(TypeError, match="C-contiguous"):
        write_bundle(tmp_path / "a.sbnd", tiny_manifest(), payloads)


def test_sections_are_zero_copy_views_that_outlive_close(tmp_path: Path) -> None:
    path = tmp_path / "a.sbnd"
    write_tiny(path)
    bundle = open_bundle(path)
    view = bundle.section("state.w")
    assert view.readonly
    assert bytes(view) == WEIGHT_BYTES
    assert bundle.section("state.w") == view  # second use: digest cached
    bundle.close()
    assert bundle.closed
    assert bytes(view) == WEIGHT_BYTES  # still valid: the mapping lives as long as the view
    with pytest.raises(BundleError, match="closed"):
        bundle.section("state.w")
    bundle.close()  # idempotent
    view.release()


def test_unknown_section_name(tmp_path: Path) -> None:
    path = tmp_path / "a.sbnd"
    write_tiny(path)
    with open_bundle(path) as bundle, pytest.raises(KeyError, match="no section named 'nope'"):
        bundle.section("nope")


def test_bundle_properties(tmp_path: Path) -> None:
    path = tmp_path / "a.sbnd"
    final = write_tiny(path)
    with open_bundle(str(path)) as bundle:
        assert bundle.path == str(path)
        assert bundle.manifest == final
        assert bundle.file_size == path.stat().st_size
        assert bundle.data_start == 1152
        assert bundle.digest.startswith("sha256:") and len(bundle.digest) == 7 + 64
        assert "Bundle" in repr(bundle)
