"""The bundle container: header, msgpack manifest, aligned raw sections.

This module turns a ``Manifest`` into bytes and back (``encode_manifest``,
``decode_manifest``), writes whole bundles atomically (``write_bundle``) and opens them
without copying their sections (``open_bundle`` -> ``Bundle``). Cross-field rules live in
``validate.py``; both directions call its ``validate`` so that no invalid bundle is written
and none is handed to a caller.

The manifest codec is driven by the dataclasses' type hints: a field's annotation decides
both how it is written and what the reader accepts, so the two directions cannot drift
apart. Reading is strict: a value of the wrong msgpack type, a missing required field or an
unknown enum value raises ``SchemaValidationError`` naming the field path.

Imports: standard library and msgpack only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import mmap
import os
import re
import secrets
import stat
import struct
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import msgpack

from .errors import (
    BundleError,
    BundleFormatError,
    IntegrityError,
    SchemaValidationError,
    UnsupportedVersionError,
)
from .manifest import (
    STATE_INPUT_KINDS,
    BatchInput,
    ConstantInput,
    HyperparameterInput,
    InputKind,
    Manifest,
    MetricOutput,
    OutputKind,
    RngSeedInput,
    Section,
    SectionKind,
    StateInput,
    StateUpdateOutput,
)
from .version import FORMAT_VERSION, check_major, check_version, format_version_string

__all__ = [
    "ALIGNMENT",
    "Bundle",
    "HEADER_FORMAT",
    "HEADER_SIZE",
    "INPUT_CLASSES",
    "MAGIC",
    "MAX_DIM",
    "MAX_MANIFEST_BYTES",
    "MAX_RANK",
    "MAX_SECTIONS",
    "OUTPUT_CLASSES",
    "SectionPayload",
    "align",
    "assemble",
    "decode_manifest",
    "encode_manifest",
    "manifest_to_wire",
    "map_key_path",
    "open_bundle",
    "pack_header",
    "read_manifest",
    "write_bundle",
]

MAGIC: bytes = b"\x89SBNDL\r\n"
"""The first 8 bytes of every bundle. The high byte and the CR LF catch transfers that
strip the eighth bit or translate line endings, as in PNG's signature."""

HEADER_SIZE: int = 64
ALIGNMENT: int = 64

HEADER_FORMAT: str = "<8sHHIQ32sQ"
"""magic, major u16, minor u16, reserved u32, manifest length u64, manifest SHA-256,
reserved u64; little-endian, no padding, 64 bytes."""

MAX_MANIFEST_BYTES: int = 64 * 1024 * 1024
"""Largest manifest a reader accepts, checked from the header before anything is read."""

MAX_SECTIONS: int = 1_000_000
MAX_RANK: int = 64
MAX_DIM: int = 2**63 - 1
"""Largest dimension, and largest byte size of any tensor: both fit an int64."""

_HEADER = struct.Struct(HEADER_FORMAT)
assert _HEADER.size == HEADER_SIZE

_INT_MIN = -(2**63)  # msgpack integers span int64 and uint64
_INT_MAX = 2**64 - 1

# Sections are hashed and written in slices of this size so that a 500 MB section never
# needs a second in-memory copy.
_CHUNK = 16 * 1024 * 1024


def align(n: int) -> int:
    """``n`` rounded up to the next multiple of ``ALIGNMENT``."""
    return -(-n // ALIGNMENT) * ALIGNMENT


# ---------------------------------------------------------------------------------------
# Type-driven manifest codec
# ---------------------------------------------------------------------------------------

INPUT_CLASSES: Mapping[InputKind, type] = {
    **{k: StateInput for k in sorted(STATE_INPUT_KINDS, key=list(InputKind).index)},
    InputKind.BATCH: BatchInput,
    InputKind.RNG_SEED: RngSeedInput,
    InputKind.HYPERPARAMETER: HyperparameterInput,
    InputKind.CONSTANT: ConstantInput,
}
"""Which record an input binding is, by its ``kind``: the reader dispatches on this and
never guesses from the keys present."""

OUTPUT_CLASSES: Mapping[OutputKind, type] = {
    OutputKind.METRIC: MetricOutput,
    OutputKind.STATE_UPDATE: StateUpdateOutput,
}
"""Which record an output binding is, by its ``kind``."""

_UNIONS: dict[frozenset[type], tuple[type[enum.Enum], Mapping[Any, type]]] = {
    frozenset(INPUT_CLASSES.values()): (InputKind, INPUT_CLASSES),
    frozenset(OUTPUT_CLASSES.values()): (OutputKind, OUTPUT_CLASSES),
}


@dataclass(frozen=True)
class _Field:
    name: str
    type: Any
    has_default: bool
    default: object


_FIELDS: dict[type, tuple[_Field, ...]] = {}


def dataclass_fields(cls: type) -> tuple[_Field, ...]:
    """The fields of a manifest record with resolved types, in declaration order."""
    cached = _FIELDS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out: list[_Field] = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append(_Field(f.name, hints[f.name], True, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append(_Field(f.name, hints[f.name], True, f.default_factory()))
        else:
            out.append(_Field(f.name, hints[f.name], False, None))
    result = tuple(out)
    _FIELDS[cls] = result
    return result


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def map_key_path(path: str, key: str) -> str:
    """Path of a map entry: ``entries.train``, or ``entries["odd name"]``."""
    if _IDENT.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{_quote(key)}]"


def _field_path(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _wire_type_name(value: object) -> str:
    """How a decoded msgpack value is described in error messages."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bytes | bytearray):
        return "binary data"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "a map"
    return type(value).__name__


def _type_name(tp: Any) -> str:
    """How an expected type is described in error messages."""
    if tp is str:
        return "a string"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a float"
    if tp is bool:
        return "a boolean"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"a {tp.__name__} value (one of {', '.join(repr(e.value) for e in tp)})"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a {tp.__name__} map"
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "an array"
    if origin is Mapping:
        return "a map"
    return str(tp)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _union_members(tp: Any) -> tuple[Any, ...]:
    return tuple(a for a in typing.get_args(tp) if a is not type(None))


# -- encoding ---------------------------------------------------------------------------


def _encode_value(tp: Any, value: object, path: str) -> object:
    """Check ``value`` against the annotation ``tp`` and return its msgpack form."""
    if tp is str:
        if type(value) is not str:
            raise SchemaValidationError(path, f"expected a str, got {type(value).__name__}.")
        return value
    if tp is bool:
        if type(value) is not bool:
            raise SchemaValidationError(path, f"expected a bool, got {type(value).__name__}.")
        return value
    if tp is int:
        if type(value) is not int:
            raise SchemaValidationError(path, f"expected an int, got {type(value).__name__}.")
        if not _INT_MIN <= value <= _INT_MAX:
            raise SchemaValidationError(
                path, f"the integer {value} does not fit in 64 bits (int64 or uint64)."
            )
        return value
    if tp is float:
        # An int is accepted where a float is annotated (as the type checker accepts it)
        # and written as the float it equals, so the file always holds a msgpack float.
        if type(value) is float:
            return value
        if type(value) is int:
            try:
                return float(value)
            except OverflowError:
                raise SchemaValidationError(path, f"{value} is too large for a float.") from None
        raise SchemaValidationError(path, f"expected a float, got {type(value).__name__}.")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if not isinstance(value, tp):
            raise SchemaValidationError(
                path, f"expected a {tp.__name__} member, got {type(value).__name__} {value!r}."
            )
        return value.value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if type(value) is not tp:
            raise SchemaValidationError(
                path, f"expected a {tp.__name__}, got {type(value).__name__}."
            )
        return _encode_record(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is Literal:
        for allowed in typing.get_args(tp):
            if value is allowed or (type(value) is type(allowed) and value == allowed):
                return allowed.value if isinstance(allowed, enum.Enum) else allowed
        raise SchemaValidationError(
            path, f"expected one of {list(typing.get_args(tp))!r}, got {value!r}."
        )
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if type(value) is not tuple:
            raise SchemaValidationError(
                path, f"expected a tuple, got {type(value).__name__}; use a tuple."
            )
        return [_encode_value(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is Mapping:
        (_key_tp, value_tp) = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise SchemaValidationError(path, f"expected a mapping, got {type(value).__name__}.")
        out: dict[str, object] = {}
        # Keys are written sorted so that equal manifests encode to equal bytes.
        for key in sorted(value, key=_sort_key(path)):
            out[key] = _encode_value(value_tp, value[key], map_key_path(path, key))
        return out
    if _is_union(tp):
        members = _union_members(tp)
        if value is None:
            if type(None) in typing.get_args(tp):
                return None
            raise SchemaValidationError(path, "expected a value, got None.")
        if len(members) == 1:
            return _encode_value(members[0], value, path)
        for member in members:
            if type(value) is member:
                return _encode_value(member, value, path)
        names = ", ".join(m.__name__ for m in members)
        raise SchemaValidationError(path, f"expected one of {names}, got {type(value).__name__}.")
    raise TypeError(f"{path}: unsupported annotation {tp!r} in the schema")  # a schema bug


def _sort_key(path: str) -> Callable[[object], str]:
    def key(k: object) -> str:
        if type(k) is not str:
            raise SchemaValidationError(path, f"keys must be str, got {type(k).__name__}.")
        return k

    return key


def _encode_record(cls: type, value: object, path: str) -> dict[str, object]:
    return {
        f.name: _encode_value(f.type, getattr(value, f.name), _field_path(path, f.name))
        for f in dataclass_fields(cls)
    }


def manifest_to_wire(manifest: Manifest) -> dict[str, object]:
    """The manifest as plain msgpack-ready data (dicts, lists, str, int, float, bool, None).

    Raises ``SchemaValidationError`` when a field holds a value of the wrong Python type.
    """
    if type(manifest) is not Manifest:
        raise SchemaValidationError("", f"expected a Manifest, got {type(manifest).__name__}.")
    return _encode_record(Manifest, manifest, "")


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest's msgpack bytes, deterministic: equal manifests give equal bytes.

    Maps are written with their keys in dataclass field order (``entries`` sorted by name).
    """
    wire = manifest_to_wire(manifest)
    try:
        data = msgpack.packb(wire, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError) as e:  # pragma: no cover - checked above
        raise SchemaValidationError("", f"the manifest cannot be encoded: {e}") from e
    assert isinstance(data, bytes)
    return data


# -- decoding ---------------------------------------------------------------------------


def _reject_ext(code: int, data: bytes) -> object:
    raise BundleFormatError(
        f"The manifest contains a msgpack extension value (type code {code}); the format "
        "uses none. The file is corrupted or was not written by stepbundle."
    )


def _pairs_to_dict(pairs: list[tuple[object, object]]) -> dict[object, object]:
    out: dict[object, object] = {}
    for key, value in pairs:
        if type(key) is not str:
            raise BundleFormatError(
                f"The manifest has a map key that is {_wire_type_name(key)}, not a string."
            )
        if key in out:
            raise BundleFormatError(
                f"The manifest has the key {key!r} twice in one map; keys must be unique."
            )
        out[key] = value
    return out


def _unpack(data: bytes) -> object:
    """Parse msgpack bytes strictly; every failure becomes a BundleFormatError."""
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_reject_ext,
            object_pairs_hook=_pairs_to_dict,
        )
    except BundleError:
        raise
    except Exception as e:
        # ValueError (malformed, truncated, extra data, too deep), UnicodeDecodeError,
        # MemoryError, RecursionError, msgpack's own exceptions, ...
        raise BundleFormatError(
            f"The manifest is not valid msgpack ({type(e).__name__}: {e}). The file is "
            "corrupted or was not written by stepbundle."
        ) from None
    # The timestamp extension (type -1) is decoded by msgpack itself, without the ext
    # hook; refuse it here so that no extension value is ever accepted.
    stack: list[object] = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, msgpack.Timestamp):
            _reject_ext(-1, b"")
    return obj


def _expect(raw: object, ok: bool, tp: Any, path: str) -> None:
    if not ok:
        raise SchemaValidationError(path, f"expected {_type_name(tp)}, got {_wire_type_name(raw)}.")


def _decode_value(tp: Any, raw: object, path: str, strict: bool) -> object:
    if tp is str:
        _expect(raw, type(raw) is str, tp, path)
        return raw
    if tp is bool:
        _expect(raw, type(raw) is bool, tp, path)
        return raw
    if tp is int:
        _expect(raw, type(raw) is int, tp, path)
        return raw
    if tp is float:
        _expect(raw, type(raw) is float, tp, path)
        return raw
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        _expect(raw, type(raw) is str, tp, path)
        try:
            return tp(raw)
        except ValueError:
            raise SchemaValidationError(
                path,
                f"unknown {tp.__name__} value {raw!r}; expected one of "
                f"{', '.join(repr(e.value) for e in tp)}.",
            ) from None
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_record(tp, raw, path, strict)
    origin = typing.get_origin(tp)
    if origin is Literal:
        for allowed in typing.get_args(tp):
            wire = allowed.value if isinstance(allowed, enum.Enum) else allowed
            if type(raw) is type(wire) and raw == wire:
                return allowed
        wires = [a.value if isinstance(a, enum.Enum) else a for a in typing.get_args(tp)]
        raise SchemaValidationError(path, f"expected one of {wires!r}, got {raw!r}.")
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        _expect(raw, type(raw) is list, tp, path)
        assert isinstance(raw, list)
        return tuple(_decode_value(item_tp, v, f"{path}[{i}]", strict) for i, v in enumerate(raw))
    if origin is Mapping:
        (_key_tp, value_tp) = typing.get_args(tp)
        _expect(raw, type(raw) is dict, tp, path)
        assert isinstance(raw, dict)
        return {
            k: _decode_value(value_tp, v, map_key_path(path, k), strict) for k, v in raw.items()
        }
    if _is_union(tp):
        if raw is None:
            if type(None) in typing.get_args(tp):
                return None
            raise SchemaValidationError(path, "expected a value, got nil.")
        members = _union_members(tp)
        if len(members) == 1:
            return _decode_value(members[0], raw, path, strict)
        return _decode_tagged(frozenset(members), raw, path, strict)
    raise TypeError(f"{path}: unsupported annotation {tp!r} in the schema")  # a schema bug


def _decode_tagged(members: frozenset[type], raw: object, path: str, strict: bool) -> object:
    """Decode one member of a union by its ``kind`` value, never by the keys present."""
    kind_enum, classes = _UNIONS[members]
    if type(raw) is not dict:
        raise SchemaValidationError(path, f"expected a map, got {_wire_type_name(raw)}.")
    if "kind" not in raw:
        raise SchemaValidationError(path, "missing required field 'kind'.")
    kind = _decode_value(kind_enum, raw["kind"], _field_path(path, "kind"), strict)
    return _decode_record(classes[kind], raw, path, strict)


def _decode_record(cls: type, raw: object, path: str, strict: bool) -> object:
    if type(raw) is not dict:
        raise SchemaValidationError(
            path, f"expected a {cls.__name__} map, got {_wire_type_name(raw)}."
        )
    fields = dataclass_fields(cls)
    if strict:
        known = {f.name for f in fields}
        for key in raw:
            if key not in known:
                raise SchemaValidationError(
                    map_key_path(path, key),
                    f"unknown field of {cls.__name__}. A bundle of this format version "
                    "may not contain it; the file is corrupted or its writer is broken.",
                )
    kwargs: dict[str, object] = {}
    for f in fields:
        if f.name in raw:
            kwargs[f.name] = _decode_value(f.type, raw[f.name], _field_path(path, f.name), strict)
        elif not f.has_default:
            raise SchemaValidationError(
                _field_path(path, f.name), f"missing required field of {cls.__name__}."
            )
    return cls(**kwargs)


def _manifest_from_wire(raw: object, strict: bool) -> Manifest:
    result = _decode_record(Manifest, raw, "", strict)
    assert isinstance(result, Manifest)
    return result


def decode_manifest(data: bytes, *, minor: int = FORMAT_VERSION[1]) -> Manifest:
    """Parse manifest bytes written by a writer of format ``(FORMAT_VERSION[0], minor)``.

    Unknown keys are errors when ``minor`` is at most this reader's minor, and are ignored
    when it is newer (forward-compatible additions). Fields with defaults may be absent.
    Does not apply the cross-field rules; see ``validate``.

    Raises:
      BundleFormatError: the bytes are not msgpack, or use an extension type.
      SchemaValidationError: a field is missing, unknown or of the wrong type.
    """
    raw = _unpack(bytes(data))
    return _guarded(lambda: _manifest_from_wire(raw, strict=minor <= FORMAT_VERSION[1]))


_T = typing.TypeVar("_T")


def _guarded(fn: Callable[[], _T]) -> _T:
    """Run a parsing step; anything but a BundleError becomes a BundleFormatError."""
    try:
        return fn()
    except BundleError:
        raise
    except Exception as e:
        raise BundleFormatError(
            f"The bundle could not be parsed ({type(e).__name__}: {e})."
        ) from None


# ---------------------------------------------------------------------------------------
# Header
# ---------------------------------------------------------------------------------------


def pack_header(manifest_bytes: bytes, version: tuple[int, int] = FORMAT_VERSION) -> bytes:
    """The 64-byte header for ``manifest_bytes`` (magic, version, length, SHA-256)."""
    return _HEADER.pack(
        MAGIC, version[0], version[1], 0, len(manifest_bytes),
        hashlib.sha256(manifest_bytes).digest(), 0,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SectionPayload:
    """The bytes of one section, handed to ``write_bundle``.

    Attributes:
      name: the section's unique name, as the manifest references it.
      kind: what the bytes are.
      data: any C-contiguous object with the buffer protocol (bytes, bytearray,
        memoryview, a numpy array); its raw bytes are written as they are. A tensor's
        bytes must already be little-endian C order (for bfloat16 pass a uint16 view).
    """

    name: str
    kind: SectionKind
    data: bytes | bytearray | memoryview


def _payload_view(payload: SectionPayload, index: int) -> memoryview:
    try:
        view = memoryview(payload.data)
        if not view.c_contiguous:
            raise TypeError("the buffer is not C-contiguous")
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"Payload {index} (section {payload.name!r}): data must be a C-contiguous "
            f"object with the buffer protocol ({e}). Pass bytes, or np.ascontiguousarray(a)."
        ) from e


def assemble(manifest: Manifest, payloads: Sequence[SectionPayload]) -> Manifest:
    """``manifest`` with ``sections`` computed from ``payloads``, laid out in their order.

    Offsets are relative to the data area: the first section at 0, each next one at the
    end of the previous rounded up to a multiple of 64. Does not validate.
    """
    sections: list[Section] = []
    offset = 0
    for i, payload in enumerate(payloads):
        view = _payload_view(payload, i)
        sections.append(
            Section(
                name=payload.name,
                kind=payload.kind,
                offset=offset,
                length=view.nbytes,
                sha256=hashlib.sha256(view).hexdigest(),
            )
        )
        offset = align(offset + view.nbytes)
    return dataclasses.replace(manifest, sections=tuple(sections))


def _fsync_directory(directory: str) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:  # pragma: no cover - platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems without directory fsync
        pass
    finally:
        os.close(fd)


def write_bundle(
    path: str | os.PathLike[str], manifest: Manifest, payloads: Sequence[SectionPayload]
) -> Manifest:
    """Write a bundle atomically and return its final manifest.

    The sections are laid out in payload order (see ``assemble``), the manifest is
    validated, and the file is written to a temporary file in the same directory, flushed
    to disk and renamed onto ``path``: a reader sees the old file or the new one, never a
    partial one. On any error the temporary file is removed and ``path`` is untouched.
    Equal inputs give byte-identical files.

    Raises:
      SchemaValidationError: the manifest breaks a rule of the schema.
      IntegrityError: a payload's bytes changed while the bundle was being written.
      OSError: the file could not be written.
    """
    from .validate import validate  # validate imports this module

    final = assemble(manifest, payloads)
    manifest_bytes = encode_manifest(final)
    data_start = align(HEADER_SIZE + len(manifest_bytes))
    last = final.sections[-1] if final.sections else None
    file_size = data_start + (last.offset + last.length if last is not None else 0)
    validate(final, file_size, manifest_length=len(manifest_bytes))

    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    temp = os.path.join(
        directory,
        f".{os.path.basename(target)}.tmp-{os.getpid()}-{secrets.token_hex(4)}",
    )
    try:
        with open(temp, "xb") as f:
            f.write(pack_header(manifest_bytes))
            f.write(manifest_bytes)
            f.write(bytes(data_start - HEADER_SIZE - len(manifest_bytes)))
            position = 0
            for i, (payload, section) in enumerate(zip(payloads, final.sections)):
                f.write(bytes(section.offset - position))
                view = _payload_view(payload, i)
                digest = hashlib.sha256()
                for start in range(0, view.nbytes, _CHUNK):
                    chunk = view[start : start + _CHUNK]
                    digest.update(chunk)
                    f.write(chunk)
                if view.nbytes != section.length or digest.hexdigest() != section.sha256:
                    raise IntegrityError(
                        f"The bytes of section {section.name!r} changed while the bundle was "
                        "being written; nothing was written. Do not modify payloads during "
                        "write_bundle."
                    )
                position = section.offset + section.length
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    _fsync_directory(directory)
    return final


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


class Bundle:
    """An open bundle: its header and manifest parsed, its sections mapped, not read.

    Obtain one with ``open_bundle``. Sections are zero-copy, read-only views of a
    memory map; each section's SHA-256 is checked the first time it is used. Use it as a
    context manager, or call ``close``. Views handed out stay valid after ``close``: the
    mapping is released when the last of them is.
    """

    def __init__(
        self,
        path: str,
        mapping: mmap.mmap,
        version: tuple[int, int],
        header: bytes,
        manifest_bytes: bytes,
        manifest: Manifest,
    ) -> None:
        """Use ``open_bundle``; this constructor trusts its arguments."""
        self._path = path
        self._mmap: mmap.mmap | None = mapping
        self._view: memoryview | None = memoryview(mapping)
        self._version = version
        self._manifest = manifest
        self._manifest_length = len(manifest_bytes)
        self._data_start = align(HEADER_SIZE + len(manifest_bytes))
        self._file_size = len(mapping)
        self._digest = "sha256:" + hashlib.sha256(header + manifest_bytes).hexdigest()
        self._verified: set[str] = set()
        # By name, built once: a runtime asks for every state tensor's section, and a
        # linear search each time would make loading quadratic in the section count.
        self._sections = {s.name: s for s in manifest.sections}

    @property
    def path(self) -> str:
        """The path the bundle was opened from."""
        return self._path

    @property
    def version(self) -> tuple[int, int]:
        """The format version in the file's header, ``(major, minor)``."""
        return self._version

    @property
    def manifest(self) -> Manifest:
        """The decoded, validated manifest."""
        return self._manifest

    @property
    def digest(self) -> str:
        """``"sha256:<hex>"`` of the header and manifest bytes; it pins the whole bundle."""
        return self._digest

    @property
    def file_size(self) -> int:
        """Size of the file in bytes."""
        return self._file_size

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data area; section offsets are relative to it."""
        return self._data_start

    def _bytes(self) -> memoryview:
        if self._view is None:
            raise BundleError(f"The bundle {self._path!r} is closed; open it again.")
        return self._view

    def section(self, name: str) -> memoryview:
        """The bytes of section ``name``: a read-only view into the mapped file.

        Raises:
          KeyError: no section has that name.
          IntegrityError: the section's bytes do not match its SHA-256 (checked once).
        """
        view = self._bytes()
        sec = self._sections.get(name)
        if sec is None:
            raise KeyError(f"The bundle {self._path!r} has no section named {name!r}.")
        start = self._data_start + sec.offset
        data = view[start : start + sec.length]
        if name not in self._verified:
            actual = hashlib.sha256(data).hexdigest()
            if actual != sec.sha256:
                data.release()
                raise IntegrityError(
                    f"Section {name!r} of {self._path!r} is damaged: its SHA-256 is "
                    f"{actual}, but the manifest records {sec.sha256}. The file was altered "
                    "or corrupted after it was written; copy or export it again."
                )
            self._verified.add(name)
        return data

    def verify(self) -> list[str]:
        """Check every section's digest and that all padding is zero.

        Returns human-readable descriptions of every problem found; empty when the
        bundle is intact.
        """
        view = self._bytes()
        failures: list[str] = []

        def check_padding(start: int, end: int, where: str) -> None:
            if any(view[start:end].tobytes()):
                failures.append(f"padding {where} (bytes {start} to {end}) is not all zero")

        check_padding(HEADER_SIZE + self._manifest_length, self._data_start, "after the manifest")
        previous_end = self._data_start
        for sec in self._manifest.sections:
            start = self._data_start + sec.offset
            check_padding(previous_end, start, f"before section {sec.name!r}")
            actual = hashlib.sha256(view[start : start + sec.length]).hexdigest()
            if actual != sec.sha256:
                failures.append(
                    f"section {sec.name!r}: SHA-256 is {actual}, the manifest records {sec.sha256}"
                )
            else:
                self._verified.add(sec.name)
            previous_end = start + sec.length
        return failures

    def close(self) -> None:
        """Release the mapping (once no section view is alive any more)."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mmap is not None:
            # BufferError: section views are still alive; the mapping goes away with the
            # last of them.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    @property
    def closed(self) -> bool:
        """True once ``close`` has been called."""
        return self._view is None

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<Bundle {self._path!r} format {format_version_string(self._version)} "
            f"{self._digest} {state}>"
        )


def _truncated(path: str, size: int, needed: int, what: str) -> BundleFormatError:
    return BundleFormatError(
        f"{path!r} is truncated: {what} needs {needed} bytes, but the file has only {size}. "
        "Copy or download the bundle again."
    )


def open_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Open and check a bundle: header, manifest digest, version, schema, layout.

    Only the header and manifest are read; sections are mapped and checked when used.

    Raises:
      OSError: the file cannot be opened.
      BundleFormatError: not a bundle, truncated, or malformed.
      UnsupportedVersionError: a version or required feature this reader does not support.
      IntegrityError: the manifest does not match the digest in the header.
      SchemaValidationError: the manifest breaks a rule of the schema.
    """
    fspath = os.fspath(path)
    # O_NONBLOCK: opening a FIFO by mistake must not hang; it has no effect on files.
    fd = os.open(fspath, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BundleFormatError(f"{fspath!r} is not a regular file, so it is not a bundle.")
        if st.st_size == 0:
            raise BundleFormatError(
                f"{fspath!r} is empty (0 bytes), so it is not a bundle. The write that "
                "produced it failed or was interrupted; export it again."
            )
        try:
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except ValueError as e:
            raise BundleFormatError(f"{fspath!r} cannot be memory-mapped: {e}.") from None
    finally:
        os.close(fd)
    try:
        return _guarded(lambda: _parse(fspath, mapping))
    except BaseException:
        mapping.close()
        raise


def _parse(path: str, mapping: mmap.mmap) -> Bundle:
    from .validate import validate  # validate imports this module

    size = len(mapping)
    head = mapping[: min(size, HEADER_SIZE)]
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise BundleFormatError(
            f"{path!r} is not a stepbundle bundle: it starts with {head[:8].hex()}, "
            f"not the magic {MAGIC.hex()}."
        )
    if size < HEADER_SIZE:
        raise _truncated(path, size, HEADER_SIZE, "the header")
    magic, major, minor, reserved1, manifest_length, manifest_sha, reserved2 = _HEADER.unpack(head)
    version = (major, minor)
    check_major(version)
    if reserved1 != 0 or reserved2 != 0:
        raise BundleFormatError(
            f"{path!r} has non-zero reserved header fields (bytes 12-15 or 56-63); the "
            "header is corrupted."
        )
    if manifest_length > MAX_MANIFEST_BYTES:
        raise BundleFormatError(
            f"{path!r} declares a manifest of {manifest_length} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} bytes a reader accepts; the header is corrupted."
        )
    manifest_end = HEADER_SIZE + manifest_length
    if manifest_end > size:
        raise _truncated(path, size, manifest_end, "the header and manifest")
    manifest_bytes = mapping[HEADER_SIZE:manifest_end]
    if hashlib.sha256(manifest_bytes).digest() != manifest_sha:
        raise IntegrityError(
            f"The manifest of {path!r} does not match the SHA-256 in its header: the file "
            "was altered or corrupted after it was written. Copy or export it again."
        )
    raw = _unpack(manifest_bytes)
    newer = minor > FORMAT_VERSION[1]
    # Refuse unknown required features before decoding the rest, which may use them.
    if isinstance(raw, dict):
        features = raw.get("required_features")
        if isinstance(features, list) and all(type(f) is str for f in features):
            check_version(version, typing.cast(list[str], features))
    try:
        manifest = _manifest_from_wire(raw, strict=not newer)
    except SchemaValidationError as e:
        if not newer:
            raise
        raise _newer_minor_error(path, version, e) from None
    check_version(version, manifest.required_features)
    data_start = align(manifest_end)
    if data_start > size:
        raise _truncated(path, size, data_start, "the padding after the manifest")
    # A short data area is reported as truncation, before validate's layout rules.
    ends = [(s.offset + s.length, s.name) for s in manifest.sections]
    if ends:
        end, name = max(ends)
        if data_start + end > size:
            raise _truncated(path, size, data_start + end, f"section {name!r}")
    validate(manifest, size, manifest_length=manifest_length)
    return Bundle(path, mapping, version, bytes(head), manifest_bytes, manifest)


def _newer_minor_error(
    path: str, version: tuple[int, int], error: SchemaValidationError
) -> UnsupportedVersionError:
    """A newer minor's manifest that this reader cannot decode is a version problem."""
    return UnsupportedVersionError(
        f"{path!r} has format version {format_version_string(version)}, newer than this "
        f"reader's {format_version_string(FORMAT_VERSION)}, and uses something this reader "
        f"does not know ({error}). Upgrade stepbundle to read it.",
        found=version,
    )


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Open, check and close a bundle; return its manifest."""
    with open_bundle(path) as bundle:
        return bundle.manifest
