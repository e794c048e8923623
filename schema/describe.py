"""A generated, committed description of the schema, and the version bump a change needs.

``describe()`` walks the manifest's dataclasses (every record reachable from ``Manifest``)
and returns plain JSON data: each record's fields in order with a normalized type string
and whether it has a default, each enum's values, each tagged union's kind table, and the
container constants. ``schema.json`` beside this file is that description, committed,
with the format version it describes. A test compares it with the code and *refuses* a
change unless ``FORMAT_VERSION`` moved as ``required_bump`` says the change needs
(``version_refusal``), and ``--write`` refuses to record such a change:

* major: a record, field, enum or enum value removed; a type changed; a field without a
  default added; a default changed or removed; a container constant changed;
* minor: a record, enum, enum value, union kind or a field with a default added.

Usage::

    python -m stepbundle.schema.describe            # print the description
    python -m stepbundle.schema.describe --write    # rewrite schema/schema.json, if allowed
    python -m stepbundle.schema.describe --check    # exit 1 if schema.json is stale

Imports: standard library only (and this package).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

from .layout import ALIGNMENT, HEADER_FORMAT, HEADER_SIZE, MAGIC
from .limits import MAX_DIM, MAX_MANIFEST_BYTES, MAX_RANK, MAX_SECTIONS
from .manifest import Manifest
from .records import INPUT_CLASSES, OUTPUT_CLASSES, dataclass_fields
from .version import FORMAT_VERSION, format_version_string
from .wire import encode_value

__all__ = [
    "SCHEMA_JSON",
    "WRITE_COMMAND",
    "allowed_versions",
    "bump_reasons",
    "describe",
    "main",
    "render",
    "required_bump",
    "version_refusal",
]

SCHEMA_JSON: Path = Path(__file__).with_name("schema.json")
"""The committed description."""

WRITE_COMMAND = "python -m stepbundle.schema.describe --write"

_UNION_NAMES: dict[frozenset[type], str] = {
    frozenset(INPUT_CLASSES.values()): "InputBinding",
    frozenset(OUTPUT_CLASSES.values()): "OutputBinding",
}


def _type_string(tp: Any) -> str:
    """A spelling of an annotation that does not depend on how the source wrote it."""
    if tp is type(None):
        return "None"
    if tp in (str, int, float, bool):
        return str(tp.__name__)
    if isinstance(tp, type) and (issubclass(tp, enum.Enum) or dataclasses.is_dataclass(tp)):
        return tp.__name__
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple:
        return f"tuple[{_type_string(args[0])}, ...]"
    if origin is Mapping:
        return f"map[{_type_string(args[0])}, {_type_string(args[1])}]"
    if origin is Literal:
        values = [a.value if isinstance(a, enum.Enum) else a for a in args]
        return "literal[" + ", ".join(json.dumps(v) for v in values) + "]"
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        name = _UNION_NAMES.get(frozenset(members))
        parts = [name] if name is not None else [_type_string(m) for m in members]
        if len(members) != len(args):
            parts.append("None")
        return " | ".join(parts)
    raise TypeError(f"unsupported annotation {tp!r} in the schema")


def _reachable(tp: Any, records: dict[str, type], enums: dict[str, type[enum.Enum]]) -> None:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        enums.setdefault(tp.__name__, tp)
        return
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if tp.__name__ in records:
            return
        records[tp.__name__] = tp
        for f in dataclass_fields(tp):
            _reachable(f.type, records, enums)
        return
    for arg in typing.get_args(tp):
        if isinstance(arg, enum.Enum):
            enums.setdefault(type(arg).__name__, type(arg))
        elif not isinstance(arg, str) and arg is not Ellipsis:
            _reachable(arg, records, enums)


def describe() -> dict[str, Any]:
    """The schema as JSON-able data, generated from the manifest's dataclasses."""
    records: dict[str, type] = {}
    enums: dict[str, type[enum.Enum]] = {}
    _reachable(Manifest, records, enums)
    for cls in (*INPUT_CLASSES.values(), *OUTPUT_CLASSES.values()):
        _reachable(cls, records, enums)
    described_records: dict[str, Any] = {}
    for name, cls in records.items():
        fields: list[dict[str, Any]] = []
        for f in dataclass_fields(cls):
            item: dict[str, Any] = {
                "name": f.name,
                "type": _type_string(f.type),
                "has_default": f.has_default,
            }
            if f.has_default:
                item["default"] = encode_value(f.type, f.default, f"{name}.{f.name}")
            fields.append(item)
        described_records[name] = {"fields": fields}
    return {
        "format_version": list(FORMAT_VERSION),
        "container": {
            "magic": MAGIC.hex(),
            "header_size": HEADER_SIZE,
            "header_format": HEADER_FORMAT,
            "alignment": ALIGNMENT,
            "max_manifest_bytes": MAX_MANIFEST_BYTES,
            "max_sections": MAX_SECTIONS,
            "max_rank": MAX_RANK,
            "max_dim": MAX_DIM,
        },
        "dataclasses": described_records,
        "enums": {name: [e.value for e in cls] for name, cls in enums.items()},
        "unions": {
            "InputBinding": {k.value: c.__name__ for k, c in INPUT_CLASSES.items()},
            "OutputBinding": {k.value: c.__name__ for k, c in OUTPUT_CLASSES.items()},
        },
    }


def render(description: Mapping[str, Any]) -> str:
    """The text of ``schema.json``: sorted keys, indent 2, trailing newline."""
    return json.dumps(description, sort_keys=True, indent=2) + "\n"


def bump_reasons(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every difference between two descriptions as ``(bump, reason)`` pairs."""
    out: list[tuple[str, str]] = []
    old_records: Mapping[str, Any] = old.get("dataclasses", {})
    new_records: Mapping[str, Any] = new.get("dataclasses", {})
    for name in old_records:
        if name not in new_records:
            out.append(("major", f"dataclass {name} removed"))
    for name in new_records:
        if name not in old_records:
            out.append(("minor", f"dataclass {name} added"))
            continue
        old_fields = {f["name"]: f for f in old_records[name]["fields"]}
        new_fields = {f["name"]: f for f in new_records[name]["fields"]}
        for fname, of in old_fields.items():
            nf = new_fields.get(fname)
            where = f"{name}.{fname}"
            if nf is None:
                out.append(("major", f"field {where} removed"))
                continue
            if of["type"] != nf["type"]:
                out.append(("major", f"field {where} changed type {of['type']} -> {nf['type']}"))
            if of["has_default"] and not nf["has_default"]:
                out.append(("major", f"field {where} lost its default"))
            elif nf["has_default"] and not of["has_default"]:
                out.append(("minor", f"field {where} gained a default"))
            elif of.get("default") != nf.get("default"):
                out.append(("major", f"field {where} changed its default"))
        for fname, nf in new_fields.items():
            if fname not in old_fields:
                if nf["has_default"]:
                    out.append(("minor", f"field {name}.{fname} added with a default"))
                else:
                    out.append(("major", f"field {name}.{fname} added without a default"))
    for group, what in (("enums", "enum"), ("unions", "union")):
        old_group: Mapping[str, Any] = old.get(group, {})
        new_group: Mapping[str, Any] = new.get(group, {})
        for name, old_values in old_group.items():
            if name not in new_group:
                out.append(("major", f"{what} {name} removed"))
                continue
            new_values = new_group[name]
            for v in old_values:
                if v not in new_values:
                    out.append(("major", f"{what} {name} lost value {v!r}"))
                elif group == "unions" and old_values[v] != new_values[v]:
                    out.append(("major", f"union {name} kind {v!r} changed record"))
            for v in new_values:
                if v not in old_values:
                    out.append(("minor", f"{what} {name} gained value {v!r}"))
        for name in new_group:
            if name not in old_group:
                out.append(("minor", f"{what} {name} added"))
    old_container: Mapping[str, Any] = old.get("container", {})
    new_container: Mapping[str, Any] = new.get("container", {})
    for key in sorted(set(old_container) | set(new_container)):
        if old_container.get(key) != new_container.get(key):
            out.append(("major", f"container constant {key} changed"))
    return out


def required_bump(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """``"major"``, ``"minor"`` or ``None``: the format version bump from ``old`` to ``new``."""
    bumps = {bump for bump, _ in bump_reasons(old, new)}
    if "major" in bumps:
        return "major"
    if "minor" in bumps:
        return "minor"
    return None


def allowed_versions(old: tuple[int, int], bump: str | None) -> tuple[tuple[int, int], ...]:
    """The format versions a schema change of kind ``bump`` may move ``old`` to.

    No change may keep the version (or move it, for a change of meaning the description
    cannot see); a minor change needs the next minor or the next major; a major change
    needs the next major. Skipping versions is refused, so every version has a
    description and golden bundles.
    """
    next_minor = (old[0], old[1] + 1)
    next_major = (old[0] + 1, 0)
    if bump is None:
        return (old, next_minor, next_major)
    if bump == "minor":
        return (next_minor, next_major)
    return (next_major,)


def version_refusal(committed: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """Why ``current`` may not replace the ``committed`` description, or ``None``.

    Refused when the schema changed but the format version did not move as the change
    requires (see ``allowed_versions``). The message names the bump, the version to set
    and the command that then rewrites ``schema.json``.
    """
    old = _version(committed)
    new = _version(current)
    bump = required_bump(committed, current)
    allowed = allowed_versions(old, bump)
    if new in allowed:
        return None
    reasons = "; ".join(f"{kind}: {reason}" for kind, reason in bump_reasons(committed, current))
    change = f"The schema changed ({reasons}), which needs a {bump} format version bump"
    if bump is None:
        change = "The schema did not change, so the format version may move by one step at most"
    wanted = " or ".join(format_version_string(v) for v in allowed)
    return (
        f"{change}: FORMAT_VERSION is {format_version_string(new)} and {SCHEMA_JSON.name} "
        f"records {format_version_string(old)}. Set FORMAT_VERSION in schema/version.py to "
        f"{wanted} (with a dated changelog line), make that version's golden bundles "
        f"(python tests/golden/make_golden.py), then run: {WRITE_COMMAND}"
    )


def _version(description: Mapping[str, Any]) -> tuple[int, int]:
    major, minor = description["format_version"]
    return (int(major), int(minor))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print, ``--write`` or ``--check`` the committed description.

    ``--write`` refuses (exit 1) a change the format version has not moved for.
    """
    parser = argparse.ArgumentParser(prog="python -m stepbundle.schema.describe")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"rewrite {SCHEMA_JSON.name}")
    group.add_argument(
        "--check", action="store_true", help=f"exit 1 if {SCHEMA_JSON.name} is stale"
    )
    args = parser.parse_args(argv)
    current = describe()
    text = render(current)
    if not (args.write or args.check):
        sys.stdout.write(text)
        return 0
    try:
        committed_text = SCHEMA_JSON.read_text(encoding="utf-8")
    except FileNotFoundError:
        if args.write:
            SCHEMA_JSON.write_text(text, encoding="utf-8")
            return 0
        print(f"{SCHEMA_JSON} is missing; run: {WRITE_COMMAND}", file=sys.stderr)
        return 1
    if committed_text == text:
        return 0
    committed = json.loads(committed_text)
    refusal = version_refusal(committed, current)
    if refusal is not None:
        print(f"Refused: {refusal}", file=sys.stderr)
        for kind, reason in bump_reasons(committed, current):
            print(f"  {kind}: {reason}", file=sys.stderr)
        return 1
    if args.write:
        SCHEMA_JSON.write_text(text, encoding="utf-8")
        return 0
    bump = required_bump(committed, current)
    print(
        f"{SCHEMA_JSON} is stale; the change needs a {bump or 'no'} version bump and "
        f"FORMAT_VERSION has moved as needed. Run: {WRITE_COMMAND}",
        file=sys.stderr,
    )
    for kind, reason in bump_reasons(committed, current):
        print(f"  {kind}: {reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
