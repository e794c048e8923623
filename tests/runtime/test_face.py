"""The package's face (``from stepbundle import load, ...``) in the lean environment: the
runtime's names work without torch, exporting says which extra to install, and importing
the format pulls in neither jax nor torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from runtime_helpers import golden_bundle

import stepbundle
from stepbundle import (
    CompileOptions,
    FrontendMissingError,
    LoadOptions,
    Trainer,
    choose_frontend,
    load,
)


def test_the_runtime_names_are_the_runtimes() -> None:
    import stepbundle.runtime as runtime

    assert (load, LoadOptions, Trainer) == (runtime.load, runtime.LoadOptions, runtime.Trainer)
    for part in ("CompileOptions", "StateOptions", "SafetyOptions", "ParallelOptions"):
        assert getattr(stepbundle, part) is getattr(runtime, part) and part in stepbundle.__all__
    trainer = load(golden_bundle("linear_adamw"), "cpu", LoadOptions(CompileOptions()))
    assert isinstance(trainer, Trainer)
    # Printed, it says which bundle, where and how far.
    assert repr(trainer) == (
        f"<Trainer {trainer.digest[:19]}... on {trainer.device}, step 0, entries eval, train>"
    )
    x = np.ones((8, 5), np.float32)
    y = np.zeros((8, 3), np.float32)
    assert np.isfinite(float(trainer.step({"x": x, "y": y})["loss"]))


def test_exporting_without_torch_names_the_extra() -> None:
    with pytest.raises(FrontendMissingError, match=r"pip install 'stepbundle\[export-torch\]'"):
        choose_frontend()
    with pytest.raises(FrontendMissingError, match="torch_xla front-end needs torch and torch_xla"):
        stepbundle.export(None, "x.stepbundle", frontend="torch_xla")  # type: ignore[arg-type]
    # The Recipe the README imports beside load: typed, with the extra, not "No module
    # named 'torch'" (a ModuleNotFoundError under no root).
    with pytest.raises(FrontendMissingError, match=r"torch is not installed.*export-torch"):
        from stepbundle import Recipe  # noqa: F401
    with pytest.raises(ImportError):  # and still the ImportError it was
        stepbundle.Recipe  # noqa: B018
    with pytest.raises(ValueError, match="frontend must be one of"):
        choose_frontend("tensorflow")
    with pytest.raises(AttributeError, match="no attribute 'lod'"):
        stepbundle.lod  # type: ignore[attr-defined]  # noqa: B018


def test_importing_the_format_or_the_package_pulls_in_no_jax() -> None:
    code = (
        "import sys, stepbundle, stepbundle.schema; "
        "print(sorted(m for m in ('jax', 'torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
