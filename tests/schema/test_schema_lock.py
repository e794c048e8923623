"""The schema lock: each format version's description is frozen, and changes need a bump.

The baseline is ``tests/golden/v<major>.<minor>/schema.json``, written once per format
version beside that version's golden bundles and never rewritten (its digest is pinned
below), not the shipped ``schema/schema.json``: rewriting that copy by hand or from the
print mode records nothing. The live description must equal the newest frozen one while
``FORMAT_VERSION`` is that version; otherwise the version must have moved as the change
requires and have its own golden bundles.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stepbundle.schema import describe as describe_module
from stepbundle.schema.describe import (
    FROZEN_ROOT,
    GOLDEN_COMMAND,
    WRITE_COMMAND,
    describe,
    frozen_path,
    frozen_versions,
    golden_bundles,
    lock_refusal,
    render,
)
from stepbundle.schema.version import FORMAT_VERSION

# sha256 of each frozen description. A new format version adds its line once; an existing
# line never changes (a frozen description is the evidence of what that version was).
FROZEN_SHA256: dict[tuple[int, int], str] = {
    (1, 0): "32d55a0b8c2ee817424452caa2fdc4b460ef1a0e655d082f2f4fc0bdc0605ec1",
    (1, 1): "12eee02504eed8328f121eab22f9530ab1f65d98a89d56b299f2d9e75a4a3e27",
    (1, 2): "ffd84c7cca7195eb985d27742e72163ffddd5a6ec912eceaab03d988996f0d85",
}


def test_the_live_description_passes_the_lock() -> None:
    refusal = lock_refusal(describe(), FROZEN_ROOT)
    assert refusal is None, f"Refused: {refusal}"


def test_frozen_descriptions_are_never_rewritten() -> None:
    versions = frozen_versions(FROZEN_ROOT)
    assert versions, f"no frozen description under {FROZEN_ROOT}"
    for version in versions:
        path = frozen_path(FROZEN_ROOT, version)
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        assert version in FROZEN_SHA256, (
            f"{path} is new: pin it in FROZEN_SHA256 as {version}: {digest!r} (once)."
        )
        assert digest == FROZEN_SHA256[version], (
            f"{path} was rewritten. A frozen description never changes; restore it from git "
            "and make a new format version for the change."
        )
        assert json.loads(data)["format_version"] == list(version), path
    assert set(FROZEN_SHA256) == set(versions), "a pinned frozen description is missing"


def test_every_golden_folder_has_its_frozen_description() -> None:
    folders = [p for p in FROZEN_ROOT.glob("v*") if p.is_dir() and any(p.glob("*.stepbundle"))]
    assert folders
    for folder in folders:
        assert (folder / "schema.json").is_file(), f"{folder} has no frozen schema.json"


def test_the_current_format_version_has_golden_bundles() -> None:
    assert golden_bundles(FROZEN_ROOT, FORMAT_VERSION), GOLDEN_COMMAND


# the lock on synthetic trees: a temporary golden root and modified descriptions.


def _with_version(d: dict[str, Any], version: tuple[int, int]) -> dict[str, Any]:
    out = copy.deepcopy(d)
    out["format_version"] = list(version)
    return out


def _add_field(d: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(d)
    out["dataclasses"]["Section"]["fields"].append(
        {"name": "compression", "type": "str | None", "has_default": True, "default": None}
    )
    return out


def _remove_field(d: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(d)
    fields = out["dataclasses"]["Program"]["fields"]
    out["dataclasses"]["Program"]["fields"] = [f for f in fields if f["name"] != "platforms"]
    return out


def _golden(root: Path, version: tuple[int, int], frozen: dict[str, Any] | None) -> None:
    """A golden folder for ``version`` with one (fake) bundle and, if given, a frozen file."""
    folder = root / f"v{version[0]}.{version[1]}"
    folder.mkdir(parents=True)
    (folder / "linear_adamw.stepbundle").write_bytes(b"")
    if frozen is not None:
        (folder / "schema.json").write_text(render(frozen), encoding="utf-8")


@pytest.fixture
def base() -> dict[str, Any]:
    return _with_version(describe(), (1, 0))


@pytest.fixture
def root(tmp_path: Path, base: dict[str, Any]) -> Path:
    out = tmp_path / "tests" / "golden"
    _golden(out, (1, 0), base)
    return out


def test_an_unchanged_description_passes(root: Path, base: dict[str, Any]) -> None:
    assert lock_refusal(copy.deepcopy(base), root) is None


def test_a_change_at_the_frozen_version_is_refused(root: Path, base: dict[str, Any]) -> None:
    refusal = lock_refusal(_add_field(base), root)
    assert refusal is not None
    assert "field Section.compression added with a default" in refusal
    assert "FORMAT_VERSION is still 1.0" in refusal
    assert "frozen in tests/golden/v1.0/schema.json and never changes" in refusal
    assert "needs a minor format version bump" in refusal
    assert "schema/version.py to 1.1 or 2.0" in refusal
    assert GOLDEN_COMMAND in refusal and WRITE_COMMAND in refusal

    refusal = lock_refusal(_remove_field(base), root)
    assert refusal is not None
    assert "field Program.platforms removed" in refusal
    assert "needs a major format version bump" in refusal
    assert "schema/version.py to 2.0 (" in refusal

    reordered = copy.deepcopy(base)
    reordered["dataclasses"]["Section"]["fields"].reverse()
    refusal = lock_refusal(reordered, root)
    assert refusal is not None and "FORMAT_VERSION is still 1.0" in refusal


def test_a_bump_must_be_the_one_the_change_needs(root: Path, base: dict[str, Any]) -> None:
    # A field added with a default needs a minor bump: 1.1 (or 2.0), not 1.2.
    added = _add_field(base)
    refusal = lock_refusal(_with_version(added, (1, 2)), root)
    assert refusal is not None and "needs a minor format version bump" in refusal
    assert "tests/golden/v1.0/schema.json records 1.0" in refusal
    # A removed field needs a major bump: 1.1 is refused.
    removed = _remove_field(base)
    refusal = lock_refusal(_with_version(removed, (1, 1)), root)
    assert refusal is not None
    assert "needs a major format version bump" in refusal
    assert "FORMAT_VERSION is 1.1" in refusal and "to 2.0 (" in refusal
    # Going back below the newest frozen version is refused too.
    _golden(root, (1, 1), _with_version(added, (1, 1)))
    assert lock_refusal(_with_version(added, (1, 0)), root) is not None


def test_a_bump_needs_golden_bundles_then_a_frozen_description(
    root: Path, base: dict[str, Any]
) -> None:
    current = _with_version(_add_field(base), (1, 1))
    refusal = lock_refusal(current, root)
    assert refusal is not None
    assert "tests/golden/v1.1/ has no golden bundles" in refusal
    assert GOLDEN_COMMAND in refusal
    assert lock_refusal(current, root, freezing=True) == refusal  # --write cannot skip it

    _golden(root, (1, 1), None)  # make_golden.py ran
    refusal = lock_refusal(current, root)
    assert refusal is not None and "not frozen yet" in refusal and WRITE_COMMAND in refusal
    assert lock_refusal(current, root, freezing=True) is None  # what --write does next

    frozen_path(root, (1, 1)).write_text(render(current), encoding="utf-8")
    assert lock_refusal(current, root) is None
    # From now on 1.1 is frozen: a further change at 1.1 is refused.
    later = copy.deepcopy(current)
    later["enums"]["DType"].append("f8e4m3")
    refusal = lock_refusal(later, root)
    assert refusal is not None and "FORMAT_VERSION is still 1.1" in refusal

    # A major change is allowed at 2.0 once 2.0 has golden bundles.
    removed = _with_version(_remove_field(current), (2, 0))
    assert lock_refusal(removed, root, freezing=True) is not None
    _golden(root, (2, 0), None)
    assert lock_refusal(removed, root, freezing=True) is None


def test_the_newest_frozen_version_is_found_by_number(tmp_path: Path, base: dict[str, Any]) -> None:
    root = tmp_path / "golden"
    for minor in (0, 2, 10, 9):
        _golden(root, (1, minor), _with_version(base, (1, minor)))
    (root / "notes").mkdir()
    assert frozen_versions(root) == ((1, 0), (1, 2), (1, 9), (1, 10))
    assert lock_refusal(_with_version(base, (1, 10)), root) is None
    refusal = lock_refusal(_with_version(base, (1, 9)), root)
    assert refusal is not None and "tests/golden/v1.10/schema.json records 1.10" in refusal


def test_no_frozen_description_is_refused(tmp_path: Path, base: dict[str, Any]) -> None:
    refusal = lock_refusal(base, tmp_path)
    assert refusal is not None and "No frozen schema description" in refusal


# the command line: --check, --write and the print mode.


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, root: Path, base: dict[str, Any]) -> dict[str, Any]:
    """The command line pointed at the temporary tree; set ``state["live"]`` to change it."""
    shipped = root.parent.parent / "schema.json"
    shipped.write_text(render(base), encoding="utf-8")
    state: dict[str, Any] = {"live": base, "shipped": shipped, "root": root}
    monkeypatch.setattr(describe_module, "FROZEN_ROOT", root)
    monkeypatch.setattr(describe_module, "SCHEMA_JSON", shipped)
    monkeypatch.setattr(describe_module, "describe", lambda: copy.deepcopy(state["live"]))
    return state


def test_write_and_check_refuse_a_change_at_the_frozen_version(
    cli: dict[str, Any], base: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    cli["live"] = _add_field(base)
    frozen = frozen_path(cli["root"], (1, 0)).read_text(encoding="utf-8")
    for args in (["--check"], ["--write"]):
        assert describe_module.main(args) == 1
        err = capsys.readouterr().err
        assert err.startswith("Refused: ") and "FORMAT_VERSION is still 1.0" in err
    assert cli["shipped"].read_text(encoding="utf-8") == render(base)  # nothing written
    assert frozen_path(cli["root"], (1, 0)).read_text(encoding="utf-8") == frozen


def test_write_freezes_a_new_version_once_it_has_golden_bundles(
    cli: dict[str, Any], base: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    current = _with_version(_add_field(base), (1, 1))
    cli["live"] = current
    assert describe_module.main(["--write"]) == 1
    assert GOLDEN_COMMAND in capsys.readouterr().err
    assert not frozen_path(cli["root"], (1, 1)).exists()

    _golden(cli["root"], (1, 1), None)
    assert describe_module.main(["--check"]) == 1
    assert "not frozen yet" in capsys.readouterr().err
    assert describe_module.main(["--write"]) == 0
    assert "froze" in capsys.readouterr().err
    assert frozen_path(cli["root"], (1, 1)).read_text(encoding="utf-8") == render(current)
    assert cli["shipped"].read_text(encoding="utf-8") == render(current)
    assert describe_module.main(["--check"]) == 0

    # A frozen file is never rewritten, even by --write.
    cli["live"] = _with_version(_add_field(_add_field(base)), (1, 1))
    assert describe_module.main(["--write"]) == 1
    assert frozen_path(cli["root"], (1, 1)).read_text(encoding="utf-8") == render(current)


def test_a_hand_edited_shipped_copy_is_stale_not_a_record(
    cli: dict[str, Any], base: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    # Recording a change in schema/schema.json does not move the lock.
    cli["shipped"].write_text(render(_add_field(base)), encoding="utf-8")
    cli["live"] = _add_field(base)
    assert describe_module.main(["--check"]) == 1
    assert "FORMAT_VERSION is still 1.0" in capsys.readouterr().err
    # An edit with the code unchanged is stale, and --write puts the live copy back.
    cli["live"] = base
    assert describe_module.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert describe_module.main(["--write"]) == 0
    assert cli["shipped"].read_text(encoding="utf-8") == render(base)
    assert describe_module.main(["--check"]) == 0


def test_check_and_write_need_a_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(describe_module, "FROZEN_ROOT", tmp_path / "missing")
    assert describe_module.main(["--check"]) == 2
    assert "need a checkout" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["shipped", "frozen"])
def test_print_mode_refuses_to_write_into_a_description(
    cli: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: Any, target: str
) -> None:
    path = cli["shipped"] if target == "shipped" else frozen_path(cli["root"], (1, 0))
    cli["live"] = _add_field(cli["live"])
    with path.open("w", encoding="utf-8") as out:  # what `... > path` does first
        monkeypatch.setattr(sys, "stdout", out)
        assert describe_module.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"Refused: standard output is {path}.")
    assert "not the schema lock" in err
    assert path.read_text(encoding="utf-8") == ""  # nothing was recorded


def test_print_mode_says_it_is_not_the_lock(tmp_path: Path) -> None:
    out = tmp_path / "description.json"
    with out.open("w", encoding="utf-8") as stdout:
        result = subprocess.run(
            [sys.executable, "-m", "stepbundle.schema.describe"],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    assert "it is not the schema lock" in result.stderr
    assert out.read_text(encoding="utf-8") == render(describe())
