"""Shared test set-up.

In the export environment, the XLA device is created before any test runs CPU
autograd (torch_xla asserts inside autograd's engine otherwise). In the lean
environment there is no torch, and only tests/schema and tests/runtime are collected.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Exports in tests of other things skip the export check (each costs a runtime process
# and a CPU compile); tests/frontends/test_frontends_export_check.py asks for it, and
# checks that it is on by default without this variable. Child processes inherit it.
os.environ.setdefault("STEPBUNDLE_EXPORT_CHECK", "0")

try:
    import torch_xla  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

# jax's CPU backend gets 4 virtual devices for the data-parallel tests (torch_xla's own
# client is not affected). Single-device tests use the first.
CPU_DEVICES = 4
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", CPU_DEVICES)

if HAVE_TORCH:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla as _txla

    _txla.device()


@pytest.fixture(scope="session")
def lean_python() -> str:
    """The lean environment's python: newest jax, no torch installed."""
    path = os.environ.get("STEPBUNDLE_LEAN_PYTHON") or str(ROOT / ".venv-lean" / "bin" / "python")
    if not Path(path).exists():
        pytest.fail(f"The lean environment is missing ({path}); run `bash scripts/setup.sh` first.")
    return path


@pytest.fixture(autouse=True)
def _private_compile_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tests never share the user's compile cache."""
    monkeypatch.setenv("STEPBUNDLE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "xla-cache"))
