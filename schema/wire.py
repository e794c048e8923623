"""The manifest's wire form: ``Manifest`` <-> msgpack bytes.

``encode_manifest`` and ``decode_manifest`` turn a manifest into deterministic msgpack
bytes and back; ``manifest_to_wire`` gives the plain data in between. The codec is driven
by the records' type hints (``records.py``): a field's annotation decides both how it is
written and what the reader accepts, so the two directions cannot drift apart. Reading is
strict: a value of the wrong msgpack type, a missing required field or an unknown enum
value raises ``SchemaValidationError`` naming the field path; bytes that are not msgpack,
or that use an extension type, raise ``BundleFormatError``. Cross-field rules are not
checked here; see ``validate.py``.

Imports: standard library and msgpack only (and this package).
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgpack

from .errors import BundleFormatError, SchemaValidationError, StepbundleError
from .manifest import Manifest
from .records import (
    UNIONS,
    dataclass_fields,
    field_path,
    is_union,
    map_key_path,
    type_name,
    union_members,
    wire_type_name,
)
from .version import FORMAT_VERSION

__all__ = [
    "decode_manifest",
    "encode_manifest",
    "encode_value",
    "guarded",
    "manifest_from_wire",
    "manifest_to_wire",
    "unpack",
]

_INT_MIN = -(2**63)  # msgpack integers span int64 and uint64
_INT_MAX = 2**64 - 1


def encode_value(tp: Any, value: object, path: str) -> object:
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
        return [encode_value(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is Mapping:
        (_key_tp, value_tp) = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise SchemaValidationError(path, f"expected a mapping, got {type(value).__name__}.")
        out: dict[str, object] = {}
        # Keys are written sorted so that equal manifests encode to equal bytes.
        for key in sorted(value, key=_sort_key(path)):
            out[key] = encode_value(value_tp, value[key], map_key_path(path, key))
        return out
    if is_union(tp):
        members = union_members(tp)
        if value is None:
            if type(None) in typing.get_args(tp):
                return None
            raise SchemaValidationError(path, "expected a value, got None.")
        if len(members) == 1:
            return encode_value(members[0], value, path)
        for member in members:
            if type(value) is member:
                return encode_value(member, value, path)
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
        f.name: encode_value(f.type, getattr(value, f.name), field_path(path, f.name))
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
                f"The manifest has a map key that is {wire_type_name(key)}, not a string."
            )
        if key in out:
            raise BundleFormatError(
                f"The manifest has the key {key!r} twice in one map; keys must be unique."
            )
        out[key] = value
    return out


def unpack(data: bytes) -> object:
    """Parse manifest msgpack bytes strictly; every failure becomes a BundleFormatError."""
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_reject_ext,
            object_pairs_hook=_pairs_to_dict,
        )
    except StepbundleError:
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
        raise SchemaValidationError(path, f"expected {type_name(tp)}, got {wire_type_name(raw)}.")


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
    if is_union(tp):
        if raw is None:
            if type(None) in typing.get_args(tp):
                return None
            raise SchemaValidationError(path, "expected a value, got nil.")
        members = union_members(tp)
        if len(members) == 1:
            return _decode_value(members[0], raw, path, strict)
        return _decode_tagged(frozenset(members), raw, path, strict)
    raise TypeError(f"{path}: unsupported annotation {tp!r} in the schema")  # a schema bug


def _decode_tagged(members: frozenset[type], raw: object, path: str, strict: bool) -> object:
    """Decode one member of a union by its ``kind`` value, never by the keys present."""
    kind_enum, classes = UNIONS[members]
    if type(raw) is not dict:
        raise SchemaValidationError(path, f"expected a map, got {wire_type_name(raw)}.")
    if "kind" not in raw:
        raise SchemaValidationError(path, "missing required field 'kind'.")
    kind = _decode_value(kind_enum, raw["kind"], field_path(path, "kind"), strict)
    return _decode_record(classes[kind], raw, path, strict)


def _decode_record(cls: type, raw: object, path: str, strict: bool) -> object:
    if type(raw) is not dict:
        raise SchemaValidationError(
            path, f"expected a {cls.__name__} map, got {wire_type_name(raw)}."
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
            kwargs[f.name] = _decode_value(f.type, raw[f.name], field_path(path, f.name), strict)
        elif not f.has_default:
            raise SchemaValidationError(
                field_path(path, f.name), f"missing required field of {cls.__name__}."
            )
    return cls(**kwargs)


def manifest_from_wire(raw: object, strict: bool) -> Manifest:
    """The manifest in ``raw``, msgpack data from ``unpack``.

    With ``strict``, unknown keys are errors; without, they are ignored (a newer minor's
    additions). Raises ``SchemaValidationError`` naming the first field that is wrong.
    """
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
    raw = unpack(bytes(data))
    return guarded(lambda: manifest_from_wire(raw, strict=minor <= FORMAT_VERSION[1]))


_T = typing.TypeVar("_T")


def guarded(fn: Callable[[], _T]) -> _T:
    """Run a parsing step; anything but stepbundle's own error becomes a BundleFormatError."""
    try:
        return fn()
    except StepbundleError:
        raise
    except Exception as e:
        raise BundleFormatError(
            f"The bundle could not be parsed ({type(e).__name__}: {e})."
        ) from None
