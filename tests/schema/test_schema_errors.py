"""One negative test per failure of open_bundle: the error class and a meaningful message."""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_helpers import data_area, pack, raw_bundle, tiny_manifest, wire_of, write_tiny

from stepbundle.schema import (
    BundleError,
    BundleFormatError,
    DType,
    IntegrityError,
    SchemaValidationError,
    StateEntry,
    StateKind,
    TensorSpec,
    UnsupportedVersionError,
    open_bundle,
)
from stepbundle.schema.limits import MAX_MANIFEST_BYTES


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.sbnd"
    write_tiny(path)
    return path


def _rewrite(tmp_path: Path, data: bytes, name: str = "bad.sbnd") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _with_wire(
    tiny: Path, tmp_path: Path, edit: Any, version: tuple[int, int] = (1, 0), extra: bytes = b""
) -> Path:
    """The tiny bundle with its manifest edited (digest recomputed) and the same data area."""
    wire = wire_of(tiny_manifest_of(tiny))
    edit(wire)
    data = raw_bundle(pack(wire), data_area(tiny.read_bytes()) + extra, version)
    return _rewrite(tmp_path, data)


def tiny_manifest_of(path: Path) -> Any:
    with open_bundle(path) as bundle:
        return bundle.manifest


def _set(wire: Any, path: list[Any], value: Any) -> None:
    for key in path[:-1]:
        wire = wire[key]
    wire[path[-1]] = value


# -- container ----------------------------------------------------------------------------


def test_zero_length_file(tmp_path: Path) -> None:
    path = _rewrite(tmp_path, b"")
    with pytest.raises(BundleFormatError, match="empty"):
        open_bundle(path)


@pytest.mark.parametrize(
    "cut", [3, 8, 40, 63, 64, 64 + 100, 64 + 1023, 1150, 1152, 1152 + 10, 1152 + 64, 1231]
)
def test_truncated_file(tiny: Path, tmp_path: Path, cut: int) -> None:
    # 0-64 header, 64-1147 manifest, 1147-1152 padding, then sections at 1152 and 1216.
    data = tiny.read_bytes()
    assert len(data) == 1232
    path = _rewrite(tmp_path, data[:cut])
    with pytest.raises(BundleFormatError, match="truncated"):
        open_bundle(path)


def test_bad_magic(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[1] = ord("X")
    with pytest.raises(BundleFormatError, match="not a stepbundle bundle") as info:
        open_bundle(_rewrite(tmp_path, bytes(data)))
    assert "8958424e444c0d0a" in str(info.value)
    with pytest.raises(BundleFormatError, match="not a stepbundle bundle"):
        open_bundle(_rewrite(tmp_path, b"PK\x03\x04 a zip file, not a bundle", "zip.sbnd"))


def test_newer_major_is_refused(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[8:12] = struct.pack("<HH", 2, 0)
    with pytest.raises(UnsupportedVersionError, match="format version 2.0") as info:
        open_bundle(_rewrite(tmp_path, bytes(data)))
    assert "Upgrade stepbundle" in str(info.value)
    assert "1.0" in str(info.value)
    assert info.value.found == (2, 0)


def test_older_major_is_refused(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[8:12] = struct.pack("<HH", 0, 9)
    with pytest.raises(UnsupportedVersionError, match="format version 0.9") as info:
        open_bundle(_rewrite(tmp_path, bytes(data)))
    assert "Re-export" in str(info.value)


def test_newer_minor_with_unknown_required_feature_is_refused(tiny: Path, tmp_path: Path) -> None:
    def edit(wire: Any) -> None:
        wire["required_features"] = ["sparse_sections"]
        wire["sparse_layout"] = {"blocks": [1, 2]}  # a field 1.0 does not know

    path = _with_wire(tiny, tmp_path, edit, version=(1, 1))
    with pytest.raises(UnsupportedVersionError, match="'sparse_sections'") as info:
        open_bundle(path)
    assert info.value.missing_features == ("sparse_sections",)
    assert info.value.found == (1, 1)


def test_same_minor_with_unknown_required_feature_is_refused(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(tiny, tmp_path, lambda w: _set(w, ["required_features"], ["fp8"]))
    with pytest.raises(UnsupportedVersionError, match="'fp8'"):
        open_bundle(path)


def test_newer_minor_without_required_features_is_read(tiny: Path, tmp_path: Path) -> None:
    def edit(wire: Any) -> None:
        wire["future_field"] = [1, "two", None]
        wire["entries"]["train"]["programs"][0]["new_hint"] = {"x": 1}
        wire["state"][0]["sharding"] = "replicated"

    path = _with_wire(tiny, tmp_path, edit, version=(1, 7))
    with open_bundle(path) as bundle:
        assert bundle.version == (1, 7)
        assert bundle.manifest == tiny_manifest_of(tiny)
        assert bundle.verify() == []


def test_unknown_key_at_current_minor_is_an_error(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(
        tiny, tmp_path, lambda w: _set(w, ["entries", "train", "programs", 0, "new_hint"], 1)
    )
    with pytest.raises(SchemaValidationError) as info:
        open_bundle(path)
    assert info.value.path == "entries.train.programs[0].new_hint"
    assert "unknown field of Program" in str(info.value)


def test_newer_minor_with_unknown_enum_value_is_a_version_error(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(
        tiny,
        tmp_path,
        lambda w: _set(w, ["state", 0, "spec", "dtype"], "f8e4m3"),
        version=(1, 3),
    )
    with pytest.raises(UnsupportedVersionError, match="state\\[0\\].spec.dtype") as info:
        open_bundle(path)
    assert "Upgrade stepbundle" in str(info.value)


def test_nonzero_reserved_header_field(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[60] = 1
    with pytest.raises(BundleFormatError, match="reserved"):
        open_bundle(_rewrite(tmp_path, bytes(data)))


@pytest.mark.parametrize("length", [MAX_MANIFEST_BYTES + 1, 2**64 - 1])
def test_oversized_manifest_length(tiny: Path, tmp_path: Path, length: int) -> None:
    data = bytearray(tiny.read_bytes())
    data[16:24] = struct.pack("<Q", length)
    with pytest.raises(BundleFormatError, match=f"{length} bytes, more than the"):
        open_bundle(_rewrite(tmp_path, bytes(data)))


def test_manifest_digest_mismatch(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[64 + 200] ^= 0x01
    with pytest.raises(IntegrityError, match="manifest .* does not match the SHA-256"):
        open_bundle(_rewrite(tmp_path, bytes(data)))


def test_section_digest_mismatch(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[-3] ^= 0xFF  # inside section 'state.w'
    with open_bundle(_rewrite(tmp_path, bytes(data))) as bundle:
        assert bytes(bundle.section("train.program"))  # the intact section is fine
        with pytest.raises(IntegrityError, match="Section 'state.w' .* is damaged"):
            bundle.section("state.w")
        failures = bundle.verify()
    assert len(failures) == 1
    assert "section 'state.w'" in failures[0]


def test_nonzero_padding_is_reported_by_verify(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    data[1152 + 50] = 7  # padding after the 44-byte program section
    with open_bundle(_rewrite(tmp_path, bytes(data))) as bundle:
        failures = bundle.verify()
    assert failures == ["padding before section 'state.w' (bytes 1196 to 1216) is not all zero"]


# -- manifest encoding ----------------------------------------------------------------------


def test_manifest_that_is_not_msgpack(tmp_path: Path) -> None:
    path = _rewrite(tmp_path, raw_bundle(b"\xc1\xc1\xc1 not msgpack", b""))
    with pytest.raises(BundleFormatError, match="not valid msgpack"):
        open_bundle(path)


def test_manifest_with_trailing_msgpack_data(tiny: Path, tmp_path: Path) -> None:
    manifest_bytes = pack(wire_of(tiny_manifest())) + b"\x01"
    path = _rewrite(tmp_path, raw_bundle(manifest_bytes, data_area(tiny.read_bytes())))
    with pytest.raises(BundleFormatError, match="not valid msgpack"):
        open_bundle(path)


@pytest.mark.parametrize(
    "value",
    [msgpack.ExtType(7, b"payload"), msgpack.Timestamp(1, 0)],
    ids=["ext7", "timestamp"],
)
def test_manifest_with_an_extension_type(tiny: Path, tmp_path: Path, value: Any) -> None:
    # Put it where a newer-minor reader would otherwise ignore it.
    path = _with_wire(tiny, tmp_path, lambda w: _set(w, ["future"], value), version=(1, 1))
    with pytest.raises(BundleFormatError, match="extension value"):
        open_bundle(path)


def test_manifest_with_duplicate_keys(tiny: Path, tmp_path: Path) -> None:
    body = pack(wire_of(tiny_manifest()))
    assert body[0] == 0x8A
    # Append a second "rng" key to the top-level map (10 -> 11 entries).
    duplicate = b"\x8b" + body[1:] + pack("rng") + pack(None)
    path = _rewrite(tmp_path, raw_bundle(duplicate, data_area(tiny.read_bytes())))
    with pytest.raises(BundleFormatError, match="key 'rng' twice"):
        open_bundle(path)


def test_manifest_that_is_not_a_map(tmp_path: Path) -> None:
    path = _rewrite(tmp_path, raw_bundle(pack([1, 2, 3]), b""))
    with pytest.raises(SchemaValidationError, match="expected a Manifest map, got an array"):
        open_bundle(path)


@pytest.mark.parametrize(
    ("where", "value", "path", "message"),
    [
        (["state", 0, "spec", "shape", 1], "2", "state[0].spec.shape[1]", "got a string"),
        (["sections", 0, "offset"], True, "sections[0].offset", "got a boolean"),
        (["sections", 1, "length"], 16.0, "sections[1].length", "got a float"),
        (["hyperparameters", 0, "value"], 1, "hyperparameters[0].value", "got an integer"),
        (
            ["entries", "train", "programs", 0, "inputs", 1, "spec", "dtype"],
            "f128",
            "entries.train.programs[0].inputs[1].spec.dtype",
            "unknown DType value 'f128'",
        ),
        (
            ["entries", "train", "programs", 0, "inputs", 0, "kind"],
            "weights",
            "entries.train.programs[0].inputs[0].kind",
            "unknown InputKind value 'weights'",
        ),
        (["entries", "train", "updates_state"], 1, "entries.train.updates_state", "boolean"),
        (["entries", "train", "programs"], {}, "entries.train.programs", "got a map"),
        (["producer"], ["0.1.0"], "producer", "expected a Producer map, got an array"),
        (["rng", "seed"], "42", "rng.seed", "expected an integer, got a string"),
        (["entries"], [], "entries", "expected a map, got an array"),
        (["sections", 0, "name"], b"train.program", "sections[0].name", "got binary data"),
    ],
)
def test_wrong_field_types(
    tiny: Path, tmp_path: Path, where: list[Any], value: Any, path: str, message: str
) -> None:
    bundle_path = _with_wire(tiny, tmp_path, lambda w: _set(w, where, value))
    with pytest.raises(SchemaValidationError, match=message) as info:
        open_bundle(bundle_path)
    assert info.value.path == path


def test_missing_required_field(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(tiny, tmp_path, lambda w: w["state"][0].pop("trainable"))
    with pytest.raises(SchemaValidationError, match="missing required field") as info:
        open_bundle(path)
    assert info.value.path == "state[0].trainable"


def test_absent_fields_with_defaults_are_accepted(tiny: Path, tmp_path: Path) -> None:
    def edit(wire: Any) -> None:
        del wire["required_features"]
        del wire["state"][0]["aliases"]
        del wire["entries"]["train"]["programs"][0]["text_section"]
        del wire["rng"]["rule"]

    with open_bundle(_with_wire(tiny, tmp_path, edit)) as bundle:
        assert bundle.manifest == tiny_manifest_of(tiny)


def test_binding_without_kind(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(
        tiny, tmp_path, lambda w: w["entries"]["train"]["programs"][0]["inputs"][1].pop("kind")
    )
    with pytest.raises(SchemaValidationError, match="missing required field 'kind'") as info:
        open_bundle(path)
    assert info.value.path == "entries.train.programs[0].inputs[1]"


# -- layout ---------------------------------------------------------------------------------


def test_overlapping_sections(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(tiny, tmp_path, lambda w: _set(w, ["sections", 1, "offset"], 0))
    with pytest.raises(SchemaValidationError, match="overlaps section 'train.program'") as info:
        open_bundle(path)
    assert info.value.path == "sections[1].offset"


def test_gap_between_sections(tiny: Path, tmp_path: Path) -> None:
    def edit(wire: Any) -> None:
        wire["sections"][1]["offset"] = 128

    area = data_area(tiny.read_bytes())
    path = _rewrite(
        tmp_path,
        raw_bundle(
            pack(_edited(tiny, edit)),
            area[:64] + bytes(64) + area[64:],
        ),
    )
    with pytest.raises(SchemaValidationError, match="gap of 64 bytes") as info:
        open_bundle(path)
    assert info.value.path == "sections[1].offset"


def _edited(tiny: Path, edit: Any) -> Any:
    wire = wire_of(tiny_manifest_of(tiny))
    edit(wire)
    return wire


def test_misaligned_section(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(tiny, tmp_path, lambda w: _set(w, ["sections", 1, "offset"], 48))
    with pytest.raises(SchemaValidationError, match="multiple of 64"):
        open_bundle(path)


def test_trailing_bytes(tiny: Path, tmp_path: Path) -> None:
    path = _rewrite(tmp_path, tiny.read_bytes() + bytes(10))
    with pytest.raises(SchemaValidationError, match="10 trailing bytes") as info:
        open_bundle(path)
    assert info.value.path == "sections"


def test_section_past_the_end_is_truncation(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(tiny, tmp_path, lambda w: _set(w, ["sections", 1, "length"], 2**63))
    with pytest.raises(BundleFormatError, match="truncated: section 'state.w'"):
        open_bundle(path)


# -- cross-field rules ----------------------------------------------------------------------


def test_state_input_naming_missing_state(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(
        tiny,
        tmp_path,
        lambda w: _set(w, ["entries", "train", "programs", 0, "inputs", 0, "name"], "v"),
    )
    with pytest.raises(SchemaValidationError, match="no state entry is named 'v'") as info:
        open_bundle(path)
    assert info.value.path == "entries.train.programs[0].inputs[0].name"


def test_state_update_donating_another_states_input(tiny: Path, tmp_path: Path) -> None:
    def edit(wire: Any) -> None:
        # A second state 'b' of the same spec, read by a new input 4.
        b = StateEntry("b", StateKind.BUFFER, TensorSpec(DType.F32, (2, 2)), "state.w", False)
        state = wire_of(tiny_manifest())["state"][0] | {
            "name": b.name,
            "kind": b.kind.value,
            "trainable": False,
        }
        wire["state"].append(state)
        program = wire["entries"]["train"]["programs"][0]
        program["inputs"].append(dict(program["inputs"][0], name="b", kind="buffer"))
        program["outputs"][1]["donates"] = 4  # the new value of 'w' donates b's input

    path = _with_wire(tiny, tmp_path, edit)
    with pytest.raises(SchemaValidationError, match="reads state 'b'") as info:
        open_bundle(path)
    assert info.value.path == "entries.train.programs[0].outputs[1].donates"


def test_duplicate_state_names(tiny: Path, tmp_path: Path) -> None:
    path = _with_wire(tiny, tmp_path, lambda w: w["state"].append(dict(w["state"][0])))
    with pytest.raises(SchemaValidationError, match="'w' is already used by state\\[0\\]") as info:
        open_bundle(path)
    assert info.value.path == "state[1].name"


# -- robustness -----------------------------------------------------------------------------


def test_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.sbnd"
    os.mkfifo(fifo)
    with pytest.raises(BundleFormatError, match="not a regular file"):
        open_bundle(fifo)


def test_directory_is_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises((BundleFormatError, IsADirectoryError, PermissionError)):
        open_bundle(tmp_path)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_files_raise_only_bundle_errors(data: st.DataObject) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "tiny.sbnd"
        write_tiny(path)
        original = bytearray(path.read_bytes())
        mode = data.draw(st.sampled_from(["flip", "cut", "splice", "manifest"]))
        if mode == "manifest":
            # Damage the manifest but fix its digest, so that the decoder sees the damage.
            length = int.from_bytes(original[16:24], "little")
            manifest = bytearray(original[64 : 64 + length])
            for _ in range(data.draw(st.integers(1, 4))):
                i = data.draw(st.integers(0, length - 1))
                manifest[i] = data.draw(st.integers(0, 255))
            original = bytearray(raw_bundle(bytes(manifest), data_area(bytes(original))))
        elif mode == "flip":
            for _ in range(data.draw(st.integers(1, 4))):
                i = data.draw(st.integers(0, len(original) - 1))
                original[i] ^= data.draw(st.integers(1, 255))
        elif mode == "cut":
            del original[data.draw(st.integers(0, len(original) - 1)) :]
        else:
            i = data.draw(st.integers(0, len(original)))
            original[i:i] = data.draw(st.binary(min_size=1, max_size=64))
        path.write_bytes(bytes(original))
        # Anything may happen to such a file, except an error that is not a BundleError.
        with contextlib.suppress(BundleError), open_bundle(path) as bundle:
            for section in bundle.manifest.sections:
                with contextlib.suppress(IntegrityError):
                    bundle.section(section.name)
            assert isinstance(bundle.verify(), list)
