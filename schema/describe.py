"""A generated description of the schema, the version bump a change needs, and the lock.

``describe()`` walks the manifest's dataclasses (every record reachable from ``Manifest``)
and returns plain JSON data: each record's fields in order with a normalized type string
and whether it has a default, each enum's values, each tagged union's kind table, and the
container constants.

The lock. Each format version's description is frozen once, beside that version's golden
bundles, as ``tests/golden/v<major>.<minor>/schema.json``, and never rewritten (a test pins
each frozen file's digest). ``lock_refusal`` compares the live description with the newest
frozen one: at the same format version they must be identical; at another version the
version must have moved as ``required_bump`` says the change needs (``version_refusal``),
and that version must have its golden bundles (``tests/golden/make_golden.py``) before
``--write`` freezes its description:

* major: a record, field, enum or enum value removed; a type changed; a field without a
  default added; a default changed or removed; a container constant changed;
* minor: a record, enum, enum value, union kind or a field with a default added.

``schema/schema.json`` beside this file is a copy of the live description shipped with the
package for readers; it is not the lock, and rewriting it by hand or by redirecting the
print mode into it records nothing.

Usage::

    python -m stepbundle.schema.describe          # print the description (not the lock)
    python -m stepbundle.schema.describe --check  # exit 1: the lock refuses, or a stale copy
    python -m stepbundle.schema.describe --write  # if the lock allows: rewrite schema.json,
                                                  # freeze a new version's description

``--check`` and ``--write`` work in a checkout only (the frozen files live under tests/).

Imports: standard library only (and this package).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

from .layout import ALIGNMENT, HEADER_FORMAT, HEADER_SIZE, MAGIC
from .limits import MAX_DIM, MAX_MANIFEST_BYTES, MAX_RANK, MAX_SECTIONS
from .lock import (
    GOLDEN_COMMAND,
    WRITE_COMMAND,
    allowed_versions,
    bump_reasons,
    description_version,
    frozen_path,
    frozen_versions,
    golden_bundles,
    lock_refusal,
    render,
    required_bump,
    version_refusal,
)
from .manifest import Manifest
from .records import INPUT_CLASSES, OUTPUT_CLASSES, dataclass_fields
from .version import FORMAT_VERSION
from .wire import encode_value

__all__ = [
    "FROZEN_ROOT",
    "GOLDEN_COMMAND",
    "SCHEMA_JSON",
    "WRITE_COMMAND",
    "allowed_versions",
    "bump_reasons",
    "describe",
    "frozen_path",
    "frozen_versions",
    "golden_bundles",
    "lock_refusal",
    "main",
    "render",
    "required_bump",
    "version_refusal",
]

SCHEMA_JSON: Path = Path(__file__).with_name("schema.json")
"""The shipped copy of the live description (package data). Not the lock."""

FROZEN_ROOT: Path = Path(__file__).resolve().parent.parent / "tests" / "golden"
"""The checkout's golden folders, ``v<major>.<minor>``, each with its frozen ``schema.json``.
Absent from an installed wheel: the lock is a development check."""


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


def _stdout_is(paths: Sequence[Path]) -> Path | None:
    """The file of ``paths`` that standard output is redirected into, if any."""
    try:
        out = os.fstat(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        return None  # not a real file (a pipe wrapper, a test's capture)
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino):
            return path
    return None


def _print(text: str, root: Path) -> int:
    """Print mode: the description on stdout and, on stderr, a note that it is not the lock."""
    frozen = [frozen_path(root, v) for v in frozen_versions(root)]
    target = _stdout_is([SCHEMA_JSON, *frozen])
    if target is not None:
        try:
            shown = str(target.resolve().relative_to(root.resolve().parent.parent))
        except ValueError:
            shown = str(target)
        print(
            f"Refused: standard output is {target}. Print mode records nothing and is not "
            "the schema lock; the shell has already emptied that file, so restore it "
            f"(git checkout -- {shown}, from the checkout root), then use --check, or "
            f"{WRITE_COMMAND} to record a change the format version has moved for.",
            file=sys.stderr,
        )
        return 1
    sys.stdout.write(text)
    print(
        "note: this prints the live description; it is not the schema lock and records "
        f"nothing. The lock compares it with the frozen tests/golden/v<version>/schema.json: "
        f"check with --check, record with {WRITE_COMMAND}.",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print the description, or ``--check`` / ``--write`` it under the lock.

    ``--check`` exits 1 when the lock refuses or ``schema.json`` is stale. ``--write``
    refuses (exit 1, writing nothing) what the lock refuses; otherwise it rewrites
    ``schema.json`` and, for a format version with golden bundles and no frozen
    description, freezes it. A frozen description is never rewritten. Both exit 2 outside
    a checkout.
    """
    parser = argparse.ArgumentParser(prog="python -m stepbundle.schema.describe")
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--write", action="store_true", help=f"rewrite {SCHEMA_JSON.name}, if the lock allows"
    )
    group.add_argument(
        "--check", action="store_true", help="exit 1 if the lock refuses or schema.json is stale"
    )
    args = parser.parse_args(argv)
    root = FROZEN_ROOT
    current = describe()
    text = render(current)
    if not (args.write or args.check):
        return _print(text, root)
    if not root.is_dir():
        print(
            f"{root} is missing: --check and --write need a checkout, where each format "
            "version's description is frozen beside its golden bundles.",
            file=sys.stderr,
        )
        return 2
    refusal = lock_refusal(current, root, freezing=args.write)
    if refusal is not None:
        print(f"Refused: {refusal}", file=sys.stderr)
        return 1
    freeze = frozen_path(root, description_version(current))
    try:
        committed_text: str | None = SCHEMA_JSON.read_text(encoding="utf-8")
    except FileNotFoundError:
        committed_text = None
    if args.check:
        if committed_text != text:
            print(
                f"{SCHEMA_JSON} is stale (it differs from the code). Run: {WRITE_COMMAND}",
                file=sys.stderr,
            )
            return 1
        return 0
    if not freeze.exists():  # the lock allowed a new version with golden bundles
        freeze.write_text(text, encoding="utf-8")
        print(f"froze {freeze}; commit it, and never rewrite it", file=sys.stderr)
    if committed_text != text:
        SCHEMA_JSON.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
