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
import re
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

WRITE_COMMAND = "python -m stepbundle.schema.describe --write"
GOLDEN_COMMAND = "python tests/golden/make_golden.py"

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


def version_refusal(
    committed: Mapping[str, Any], current: Mapping[str, Any], recorded_in: str = "schema.json"
) -> str | None:
    """Why ``current`` may not replace the ``committed`` description, or ``None``.

    Refused when the schema changed but the format version did not move as the change
    requires (see ``allowed_versions``). The message names the bump, the version to set
    and the commands that then make the golden bundles and record the description;
    ``recorded_in`` names where ``committed`` came from.
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
        f"{change}: FORMAT_VERSION is {format_version_string(new)} and {recorded_in} "
        f"records {format_version_string(old)}. Set FORMAT_VERSION in schema/version.py to "
        f"{wanted} (with a dated changelog line), make that version's golden bundles "
        f"({GOLDEN_COMMAND}), then run: {WRITE_COMMAND}"
    )


def frozen_path(root: Path, version: tuple[int, int]) -> Path:
    """Where ``version``'s description is frozen: ``root/v<major>.<minor>/schema.json``."""
    return root / f"v{format_version_string(version)}" / "schema.json"


def frozen_versions(root: Path) -> tuple[tuple[int, int], ...]:
    """Every format version with a frozen description under ``root``, oldest first.

    Ordered by the parsed version, so ``v1.10`` comes after ``v1.2``.
    """
    found: list[tuple[int, int]] = []
    if root.is_dir():
        for folder in root.iterdir():
            match = _FOLDER.fullmatch(folder.name)
            if match and (folder / "schema.json").is_file():
                found.append((int(match.group(1)), int(match.group(2))))
    return tuple(sorted(found))


def golden_bundles(root: Path, version: tuple[int, int]) -> tuple[Path, ...]:
    """The golden bundles of ``version`` under ``root`` (none when the folder is missing)."""
    folder = root / f"v{format_version_string(version)}"
    return tuple(sorted(folder.glob("*.stepbundle"))) if folder.is_dir() else ()


def lock_refusal(current: Mapping[str, Any], root: Path, *, freezing: bool = False) -> str | None:
    """Why the live description ``current`` breaks the lock under ``root``, or ``None``.

    At the newest frozen version the description must be identical to the frozen one (a
    released version never changes); at another version ``version_refusal`` decides
    against the newest frozen one, that version needs golden bundles, and its description
    must be frozen (``freezing`` says the caller is about to freeze it: ``--write``).
    """
    versions = frozen_versions(root)
    if not versions:
        return (
            f"No frozen schema description under {root} (v<major>.<minor>/schema.json). "
            "The lock needs a checkout with its golden folders."
        )
    newest = versions[-1]
    path = frozen_path(root, newest)
    frozen = json.loads(path.read_text(encoding="utf-8"))
    live = _version(current)
    shown = f"tests/golden/v{format_version_string(newest)}/schema.json"
    if live == newest:
        if render(frozen) == render(current):
            return _golden_refusal(root, live)
        bump = required_bump(frozen, current) or "minor"
        reasons = "; ".join(f"{k}: {r}" for k, r in bump_reasons(frozen, current))
        reasons = reasons or "the description differs from the frozen one, e.g. in field order"
        wanted = " or ".join(format_version_string(v) for v in allowed_versions(newest, bump))
        return (
            f"The schema changed ({reasons}), but FORMAT_VERSION is still "
            f"{format_version_string(live)}, whose description is frozen in {shown} and never "
            f"changes: the change needs a {bump} format version bump. Set FORMAT_VERSION in "
            f"schema/version.py to {wanted} (with a dated changelog line), make that "
            f"version's golden bundles ({GOLDEN_COMMAND}), then run: {WRITE_COMMAND}"
        )
    refusal = version_refusal(frozen, current, recorded_in=shown)
    if refusal is not None:
        return refusal
    missing = _golden_refusal(root, live)
    if missing is not None or freezing:
        return missing
    return (
        f"FORMAT_VERSION {format_version_string(live)} has golden bundles but its schema "
        f"description is not frozen yet (tests/golden/v{format_version_string(live)}/"
        f"schema.json). Run: {WRITE_COMMAND}"
    )


def _golden_refusal(root: Path, version: tuple[int, int]) -> str | None:
    if golden_bundles(root, version):
        return None
    name = f"v{format_version_string(version)}"
    return (
        f"FORMAT_VERSION is {format_version_string(version)} but tests/golden/{name}/ has no "
        f"golden bundles. Every format version has its own, made once: run {GOLDEN_COMMAND} "
        f"(in the export environment), commit tests/golden/{name}/, then run: {WRITE_COMMAND}"
    )


_FOLDER = re.compile(r"v(\d+)\.(\d+)")


def _version(description: Mapping[str, Any]) -> tuple[int, int]:
    major, minor = description["format_version"]
    return (int(major), int(minor))


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
    freeze = frozen_path(root, _version(current))
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
