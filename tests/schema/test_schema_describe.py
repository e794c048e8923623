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
    bump_reasons,
    describe,
    render,
    required_bump,
)


def test_committed_schema_json_is_current() -> None:
    committed_text = SCHEMA_JSON.read_text(encoding="utf-8")
    current = describe()
    if committed_text != render(current):
        committed = json.loads(committed_text)
        bump = required_bump(committed, current)
        reasons = "; ".join(f"{k}: {r}" for k, r in bump_reasons(committed, current))
        pytest.fail(
            f"schema/schema.json is stale. This change needs a {bump or 'no'} format version "
            f"bump ({reasons}). Bump FORMAT_VERSION in schema/version.py if needed, then run "
            f"`{WRITE_COMMAND}`."
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


def test_check_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    stale = tmp_path / "schema.json"
    d = describe()
    d["dataclasses"]["Section"]["fields"].pop()  # as if sha256 had just been added
    stale.write_text(render(d), encoding="utf-8")
    monkeypatch.setattr(describe_module, "SCHEMA_JSON", stale)
    assert describe_module.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "major version bump" in err
    assert "field Section.sha256 added without a default" in err
    assert WRITE_COMMAND in err
    assert describe_module.main(["--write"]) == 0
    assert describe_module.main(["--check"]) == 0
    assert stale.read_text(encoding="utf-8") == render(describe())
