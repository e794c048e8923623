"""The schema lock: a schema change is refused unless the format version moved as the
change requires, checked against the description frozen for each version beside its
golden bundles (``tests/golden/v<major>.<minor>/schema.json``).

``describe.py`` produces the live description and runs the lock from its command line;
this module compares descriptions and says which bump a change needs.

Imports: the standard library (and this package's version module).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .version import format_version_string

__all__ = [
    "GOLDEN_COMMAND",
    "WRITE_COMMAND",
    "allowed_versions",
    "bump_reasons",
    "description_version",
    "frozen_path",
    "frozen_versions",
    "golden_bundles",
    "lock_refusal",
    "render",
    "required_bump",
    "version_refusal",
]

WRITE_COMMAND = "python -m stepbundle.schema.describe --write"
GOLDEN_COMMAND = "python tests/golden/make_golden.py"


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
    old = description_version(committed)
    new = description_version(current)
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
    live = description_version(current)
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


def description_version(description: Mapping[str, Any]) -> tuple[int, int]:
    major, minor = description["format_version"]
    return (int(major), int(minor))
