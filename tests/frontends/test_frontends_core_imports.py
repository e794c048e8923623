"""The front-end core imports no torch_xla: the torch front-end and load_into work where
torch_xla is not installed (and do not set it up where it is).

One fresh process imports the core's modules one after another and records, after each,
what of torch_xla and the torch_xla front-end it newly holds (one process instead of one
per module: each started torch and jax anew, ~15 s apiece on CI's machine). A module that
pulls torch_xla in is named by its own test; one importing it after that culprit would
only be named once the culprit is fixed, and the file fails until every one is.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

CORE = [
    "stepbundle.frontend",
    "stepbundle.frontend.checkpoint",
    "stepbundle.frontend.dtypes",
    "stepbundle.frontend.errors",
    "stepbundle.frontend.fresh_state",
    "stepbundle.frontend.hyperparameters",
    "stepbundle.frontend.initial_state",
    "stepbundle.frontend.recipe",
    "stepbundle.frontend.schedulers",
    "stepbundle.frontend.step_check",
    "stepbundle.frontend.step_compare",
    "stepbundle.frontend.step_io",
    "stepbundle.frontend.step_ties",
    "stepbundle.frontend.tables",
    "stepbundle.frontend.user_objects",
    "stepbundle.frontend.writer",
]
# The controls, imported last in the same process: the torch_xla front-end, and torch_xla
# itself where it is installed, must show, or the check could not fail.
CONTROL = "stepbundle.exporter.checkpoint"
HAVE_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def _imported_after_each(modules: list[str]) -> dict[str, list[str]]:
    """For each of ``modules``, imported in this order in one fresh process: what of
    torch_xla and the torch_xla front-end the process newly held after importing it."""
    code = (
        "import importlib, json, sys\n"
        "def bad():\n"
        "    return {m for m in sys.modules if m.split('.')[0] == 'torch_xla'"
        " or m == 'stepbundle.exporter' or m.startswith('stepbundle.exporter.')}\n"
        "seen, out = bad(), {}\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    now = bad()\n"
        "    out[name] = sorted(now - seen)\n"
        "    seen = now\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got: dict[str, list[str]] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


@pytest.fixture(scope="module")
def imported() -> dict[str, list[str]]:
    return _imported_after_each([*CORE, CONTROL, *(["torch_xla"] if HAVE_TORCH_XLA else [])])


@pytest.mark.parametrize("module", CORE)
def test_importing_the_core_imports_no_torch_xla(
    imported: dict[str, list[str]], module: str
) -> None:
    got = imported[module]
    assert got == [], f"importing {module} imported {got}"


def test_the_check_sees_torch_xla_and_the_exporter(imported: dict[str, list[str]]) -> None:
    """The control: the same check does see the torch_xla front-end (and torch_xla,
    where it is installed), so the test above could fail."""
    assert "stepbundle.exporter" in imported[CONTROL]
    pytest.importorskip("torch_xla", reason="torch_xla is installed in .venv only")
    # (newly held after the front-end, or else after importing torch_xla itself)
    assert "torch_xla" in imported[CONTROL] + imported["torch_xla"]
