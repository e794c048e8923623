"""``Recipe(metadata=...)`` goes into the manifest (format 1.1) and ``inspect`` shows it;
anything but a map of strings is refused before the step is traced."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from export_helpers import linear_sgd_recipe, mse_step

from stepbundle.cli.main import main
from stepbundle.exporter import export
from stepbundle.frontend.errors import ExportError
from stepbundle.schema import open_bundle


def test_metadata_reaches_the_manifest_and_inspect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    meta = {
        "name": "linear-regression",
        "description": "Linear(5, 3), SGD, MSE",
        "source_commit": "0123abc",
        "owner": "team-a",
    }
    recipe = dataclasses.replace(linear_sgd_recipe(mse_step), metadata=meta)
    path = tmp_path / "m.stepbundle"
    export(recipe, path)
    with open_bundle(path) as b:
        assert dict(b.manifest.metadata) == meta
        assert b.version == (1, 2)
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "name      linear-regression" in lines
    assert "description Linear(5, 3), SGD, MSE" in lines
    assert "source_commit 0123abc" in lines and "owner     team-a" in lines


@pytest.mark.parametrize(
    "bad", [["name", "x"], {"name": 3}, {"": "empty key"}, {1: "not a string key"}]
)
def test_metadata_that_is_not_strings_is_refused(bad: object, tmp_path: Path) -> None:
    def never(*_: object) -> None:
        raise AssertionError("the step was traced before the metadata was checked")

    recipe = dataclasses.replace(linear_sgd_recipe(never), metadata=bad)  # type: ignore[arg-type]
    with pytest.raises(ExportError, match="Recipe.metadata"):
        export(recipe, tmp_path / "b.stepbundle")
    assert not (tmp_path / "b.stepbundle").exists()
