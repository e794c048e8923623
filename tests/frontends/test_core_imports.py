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
    "stepbundle.frontend.step_io",
    "stepbundle.frontend.tables",
    "stepbundle.frontend.user_objects",
    "stepbundle.frontend.writer",
]


@pytest.mark.parametrize("module", CORE)
def test_importing_the_core_imports_no_torch_xla(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch_xla'"
        " or m == 'stepbundle.exporter' or m.startswith('stepbundle.exporter.'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {module} imported {out.stdout.strip()}"


def test_the_check_sees_torch_xla_where_it_is_imported() -> None:
    """The control: the torch_xla front-end does import torch_xla (so the check above
    could fail)."""
    pytest.importorskip("torch_xla", reason="the control needs torch_xla installed (.venv)")
    code = "import sys, stepbundle.exporter\nprint('torch_xla' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr
