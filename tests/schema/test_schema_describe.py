"""The committed schema description is current, and required_bump classifies changes."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from stepbundle.schema import describe as describe_module
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


def test_committed_schema_json_is_current() -> None:
    """The lock: a schema change is refused unless FORMAT_VERSION moved as it requires."""
    committed_text = SCHEMA_JSON.read_text(encoding="utf-8")
    current = describe()
    if committed_text == render(current):
        return
    committed = json.loads(committed_text)
    refusal = version_refusal(committed, current)
    if refusal is not None:
        pytest.fail(f"Refused: {refusal}")
    bump = required_bump(committed, current)
    reasons = "; ".join(f"{k}: {r}" for k, r in bump_reasons(committed, current))
    pytest.fail(
        f"schema/schema.json is stale ({reasons}); FORMAT_VERSION moved as the {bump or 'no'} "
        f"bump requires, so record it: `{WRITE_COMMAND}`."
    )


def test_description_covers_the_schema() -> None:
    d = describe()
    assert d["format_version"] == [1, 0]
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


def test_write_refuses_an_unversioned_change_and_check_says_the_bump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    stale = tmp_path / "schema.json"
    d = describe()
    d["dataclasses"]["Section"]["fields"].pop()  # as if sha256 had just been added
    stale.write_text(render(d), encoding="utf-8")
    monkeypatch.setattr(describe_module, "SCHEMA_JSON", stale)
    for args in (["--check"], ["--write"]):
        assert describe_module.main(args) == 1
        err = capsys.readouterr().err
        assert err.startswith("Refused: ")
        assert "major format version bump" in err
        assert "field Section.sha256 added without a default" in err
        assert WRITE_COMMAND in err
    assert stale.read_text(encoding="utf-8") == render(d)  # --write wrote nothing


def test_write_records_a_change_once_the_version_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    stale = tmp_path / "schema.json"
    d = _with_version(describe(), (0, 7))  # the code's 1.0 is the next major after it
    d["dataclasses"]["Section"]["fields"].pop()
    stale.write_text(render(d), encoding="utf-8")
    monkeypatch.setattr(describe_module, "SCHEMA_JSON", stale)
    assert describe_module.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "stale" in err and WRITE_COMMAND in err
    assert describe_module.main(["--write"]) == 0
    assert describe_module.main(["--check"]) == 0
    assert stale.read_text(encoding="utf-8") == render(describe())
