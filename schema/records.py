"""The manifest's records as the codec and the schema description see them.

For each record (a frozen dataclass of ``manifest.py``): its fields in declaration order
with their resolved type hints and defaults (``dataclass_fields``); for each tagged union,
which record a ``kind`` value selects (``INPUT_CLASSES``, ``OUTPUT_CLASSES``); and the
spelling of field paths and types in error messages. ``wire.py`` encodes and decodes by
these, and ``describe.py`` describes the schema by them, so the two cannot disagree.

Imports: standard library only (and this package's ``manifest``).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from .manifest import (
    STATE_INPUT_KINDS,
    BatchInput,
    ConstantInput,
    HyperparameterInput,
    InputKind,
    MetricOutput,
    OutputKind,
    RngSeedInput,
    StateInput,
    StateUpdateOutput,
)

__all__ = [
    "INPUT_CLASSES",
    "OUTPUT_CLASSES",
    "UNIONS",
    "Field",
    "dataclass_fields",
    "field_path",
    "is_union",
    "map_key_path",
    "type_name",
    "union_members",
    "wire_type_name",
]

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

UNIONS: dict[frozenset[type], tuple[type[enum.Enum], Mapping[Any, type]]] = {
    frozenset(INPUT_CLASSES.values()): (InputKind, INPUT_CLASSES),
    frozenset(OUTPUT_CLASSES.values()): (OutputKind, OUTPUT_CLASSES),
}
"""Each tagged union by its member records: the enum of its ``kind`` and its class table."""


@dataclass(frozen=True)
class Field:
    """One field of a record: its name, resolved type hint, and default if it has one."""

    name: str
    type: Any
    has_default: bool
    default: object


_FIELDS: dict[type, tuple[Field, ...]] = {}


def dataclass_fields(cls: type) -> tuple[Field, ...]:
    """The fields of a manifest record with resolved types, in declaration order."""
    cached = _FIELDS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out: list[Field] = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append(Field(f.name, hints[f.name], True, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append(Field(f.name, hints[f.name], True, f.default_factory()))
        else:
            out.append(Field(f.name, hints[f.name], False, None))
    result = tuple(out)
    _FIELDS[cls] = result
    return result


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def map_key_path(path: str, key: str) -> str:
    """Path of a map entry: ``entries.train``, or ``entries["odd name"]``."""
    if _IDENT.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{_quote(key)}]"


def field_path(path: str, name: str) -> str:
    """Path of a record's field: ``entries.train.updates_state``."""
    return f"{path}.{name}" if path else name


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def wire_type_name(value: object) -> str:
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


def type_name(tp: Any) -> str:
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


def is_union(tp: Any) -> bool:
    """True for ``A | B`` and ``Optional[A]`` annotations."""
    return typing.get_origin(tp) in (Union, types.UnionType)


def union_members(tp: Any) -> tuple[Any, ...]:
    """The members of a union annotation other than ``None``."""
    return tuple(a for a in typing.get_args(tp) if a is not type(None))
