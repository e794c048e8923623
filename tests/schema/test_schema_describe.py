"""The description covers the schema, and required_bump / version_refusal classify changes.

The lock itself (frozen descriptions per format version, the command line) is tested in
test_schema_lock.py.
"""

from __future__ import annotations

import copy
from typing import Any

from stepbundle.schema.describe import (
    SCHEMA_JSON,
    WRITE_COMMAND,
    allowed_versions,
    bump_reasons,
    describe,
    render,
    required_bump,
    version_refusal,
)


def test_shipped_schema_json_is_current() -> None:
    """schema/schema.json is the packaged copy of the live description (not the lock)."""
    assert SCHEMA_JSON.read_text(encoding="utf-8") == render(describe()), (
        f"schema/schema.json differs from the code. If the lock passes "
        f"(tests/schema/test_schema_lock.py), record it: `{WRITE_COMMAND}`."
    )


def test_description_covers_the_schema() -> None:
    d = describe()
    assert d["format_version"] == [1, 2]
    assert d["container"]["magic"] == "8953424e444c0d0a"
    manifest_fields = [f["name"] for f in d["dataclasses"]["Manifest"]["fields"]]
    assert manifest_fields == [
        "producer",
        "entries",
        "state",
        "hyperparameters",
        "rng",
        "sections",
        "required_features",
        "metadata",
        "numerics",
        "matmul_precision",
    ]
    fields = {f["name"]: f for f in d["dataclasses"]["Program"]["fields"]}
    assert fields["inputs"]["type"] == "tuple[InputBinding, ...]"
    assert fields["text_section"] == {
        "name": "text_section",
        "type": "str | None",
        "has_default": True,
        "default": None,
    }
    assert d["dataclasses"]["Manifest"]["fields"][1]["type"] == "map[str, Entry]"
    assert d["enums"]["DType"][:3] == ["f64", "f32", "bf16"]
    assert d["unions"]["InputBinding"]["parameter"] == "StateInput"
    assert set(d["dataclasses"]) >= {"StateUpdateOutput", "ConstantInput", "Rng", "NamedSpec"}


def _field(d: dict[str, Any], record: str, name: str) -> dict[str, Any]:
    fields: list[dict[str, Any]] = d["dataclasses"][record]["fields"]
    return next(f for f in fields if f["name"] == name)


def test_required_bump_on_synthetic_changes() -> None:
    old = describe()
    assert required_bump(old, copy.deepcopy(old)) is None

    new = copy.deepcopy(old)
    new["dataclasses"]["Section"]["fields"].append(
        {"name": "compression", "type": "str | None", "has_default": True, "default": None}
    )
    assert required_bump(old, new) == "minor"
    assert bump_reasons(old, new) == [("minor", "field Section.compression added with a default")]

    new = copy.deepcopy(old)
    new["dataclasses"]["Section"]["fields"].append(
        {"name": "compression", "type": "str", "has_default": False}
    )
    assert required_bump(old, new) == "major"

    new = copy.deepcopy(old)
    new["dataclasses"]["Section"]["fields"] = [
        f for f in new["dataclasses"]["Section"]["fields"] if f["name"] != "sha256"
    ]
    assert required_bump(old, new) == "major"

    new = copy.deepcopy(old)
    _field(new, "Section", "length")["type"] = "str"
    assert required_bump(old, new) == "major"
    assert ("major", "field Section.length changed type int -> str") in bump_reasons(old, new)

    new = copy.deepcopy(old)
    new["enums"]["DType"].append("f8e4m3")
    assert required_bump(old, new) == "minor"

    new = copy.deepcopy(old)
    new["enums"]["DType"].remove("bf16")
    assert required_bump(old, new) == "major"

    new = copy.deepcopy(old)
    new["dataclasses"]["Sharding"] = {"fields": []}
    assert required_bump(old, new) == "minor"

    new = copy.deepcopy(old)
    del new["dataclasses"]["Rng"]
    assert required_bump(old, new) == "major"

    new = copy.deepcopy(old)
    _field(new, "StateEntry", "aliases")["default"] = ["x"]
    assert required_bump(old, new) == "major"

    new = copy.deepcopy(old)
    new["container"]["alignment"] = 128
    assert required_bump(old, new) == "major"


def _with_version(d: dict[str, Any], version: tuple[int, int]) -> dict[str, Any]:
    out = copy.deepcopy(d)
    out["format_version"] = list(version)
    return out


def test_a_change_is_refused_until_the_version_moves_as_required() -> None:
    committed = _with_version(describe(), (1, 4))

    # A field added with a default: a minor bump, 1.4 -> 1.5 (or a major one).
    current = copy.deepcopy(committed)
    current["dataclasses"]["Section"]["fields"].append(
        {"name": "compression", "type": "str | None", "has_default": True, "default": None}
    )
    refusal = version_refusal(committed, current)
    assert refusal is not None
    assert "needs a minor format version bump" in refusal
    assert "field Section.compression added with a default" in refusal
    assert "Set FORMAT_VERSION in schema/version.py to 1.5 or 2.0" in refusal
    assert WRITE_COMMAND in refusal
    assert version_refusal(committed, _with_version(current, (1, 5))) is None
    assert version_refusal(committed, _with_version(current, (2, 0))) is None
    assert version_refusal(committed, _with_version(current, (1, 6))) is not None  # skipped

    # A required field added, a field removed, a type changed: a major bump, 1.4 -> 2.0.
    required = copy.deepcopy(committed)
    required["dataclasses"]["Section"]["fields"].append(
        {"name": "compression", "type": "str", "has_default": False}
    )
    removed = copy.deepcopy(committed)
    removed["dataclasses"]["Program"]["fields"] = [
        f for f in removed["dataclasses"]["Program"]["fields"] if f["name"] != "platforms"
    ]
    retyped = copy.deepcopy(committed)
    _field(retyped, "Section", "length")["type"] = "str"
    for current in (required, removed, retyped):
        refusal = version_refusal(committed, current)
        assert refusal is not None and "needs a major format version bump" in refusal
        assert "to 2.0 (" in refusal
        assert version_refusal(committed, _with_version(current, (1, 5))) is not None
        assert version_refusal(committed, _with_version(current, (2, 0))) is None
        assert version_refusal(committed, _with_version(current, (3, 0))) is not None

    # No schema change: the version may stay, or move one step for a change of meaning.
    assert version_refusal(committed, copy.deepcopy(committed)) is None
    assert version_refusal(committed, _with_version(committed, (1, 5))) is None
    assert version_refusal(committed, _with_version(committed, (1, 3))) is not None


def test_allowed_versions() -> None:
    assert allowed_versions((1, 0), None) == ((1, 0), (1, 1), (2, 0))
    assert allowed_versions((1, 0), "minor") == ((1, 1), (2, 0))
    assert allowed_versions((1, 2), "major") == ((2, 0),)
