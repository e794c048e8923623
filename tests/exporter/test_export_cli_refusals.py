"""`stepbundle export` refuses an output that would destroy its recipe or cannot be written,
before it builds or traces anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def export(recipe: str, output: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepbundle", "export", recipe, "-o", output],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_output_that_is_the_recipe_or_unwritable_is_refused(tmp_path: Path) -> None:
    recipe = tmp_path / "r.py"
    recipe.write_text((ROOT / "examples" / "linear_adamw.py").read_text())
    before = recipe.read_text()
    cases = {
        str(recipe): "is the recipe file; writing it would destroy it",
        str(tmp_path): "is a folder; give the bundle a file name",
        str(tmp_path / "missing" / "b.stepbundle"): "is missing or not writable",
    }
    for output, needle in cases.items():
        result = export(f"{recipe}:recipe", output)
        assert result.returncode == 2, (output, result.stderr)
        assert needle in result.stderr.strip().splitlines()[-1]
        assert "[export] recipe built" not in result.stderr  # refused before building
        assert recipe.read_text() == before
