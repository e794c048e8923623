"""The front-end core imports no torch_xla: the torch front-end and load_into work where
torch_xla is not installed (and do not set it up where it is)."""

from __future__ import annotations

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
    "stepbundle.frontend.tables",
    "stepbundle.frontend.user_objects",
    "stepbundle.frontend.writer",
]


def _imported_after(module: str) -> str:
    """What of torch_xla and the torch_xla front-end a fresh process holds after importing
    ``module``, as printed by the process."""
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch_xla'"
        " or m == 'stepbundle.exporter' or m.startswith('stepbundle.exporter.'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("module", CORE)
def test_importing_the_core_imports_no_torch_xla(module: str) -> None:
    got = _imported_after(module)
    assert got == "[]", f"importing {module} imported {got}"


def test_the_check_sees_torch_xla_and_the_exporter() -> None:
    """The control: the same check does see the torch_xla front-end (and torch_xla,
    where it is installed), so the test above could fail."""
    assert "'stepbundle.exporter'" in _imported_after("stepbundle.exporter.checkpoint")
    pytest.importorskip("torch_xla", reason="torch_xla is installed in .venv only")
    assert "'torch_xla'" in _imported_after("torch_xla")
