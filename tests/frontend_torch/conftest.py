"""Set-up of the torch front-end's tests: they run in the torch environment only.

``.venv-torch`` (``stepbundle[export-torch]``: current torch and jax, no torch_xla) runs
this folder: ``scripts/test.sh`` calls it there explicitly. The torch_xla environment
(torch 2.9) and the lean one (no torch) do not collect it: the front-end needs torch 2.10
or newer, and these tests prove it works where torch_xla is absent.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "equivalence"))
sys.path.insert(0, str(ROOT / "examples"))


def _torch_env() -> bool:
    if (
        importlib.util.find_spec("torch_xla") is not None
        or importlib.util.find_spec("torch") is None
    ):
        return False
    import torch

    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 10)


# Not this environment's tests (see the module docstring).
collect_ignore_glob = [] if _torch_env() else ["test_*.py"]


@pytest.fixture(scope="session")
def xla_python() -> str:
    """The torch_xla environment's python, for bundles from the other front-end."""
    path = os.environ.get("STEPBUNDLE_XLA_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(path).exists():
        pytest.fail(f"The torch_xla environment is missing ({path}); run `bash scripts/setup.sh`.")
    return path


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``exported(spec)``: the torch front-end's bundle of ``"module:function"``, exported
    once per session (several test modules use the same recipes)."""
    import importlib

    from stepbundle.export_torch import export

    folder = tmp_path_factory.mktemp("exported")
    done: dict[str, Path] = {}

    def get(spec: str) -> Path:
        if spec not in done:
            module, _, func = spec.partition(":")
            path = folder / f"{module}.{func}.stepbundle"
            export(getattr(importlib.import_module(module), func)(), path)
            done[spec] = path
        return done[spec]

    return get
