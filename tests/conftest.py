"""Shared test set-up.

In the export environment, the XLA device is created before any test runs CPU
autograd (torch_xla asserts inside autograd's engine otherwise). In the lean
environment there is no torch, and only tests/schema and tests/runtime are collected.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_compile import FAST_COMPILE, without_fast_compile  # noqa: E402

# Exports in tests of other things skip the export check (each costs a runtime process
# and a CPU compile); tests/frontends/test_frontends_export_check.py asks for it, and
# checks that it is on by default without this variable. Child processes inherit it.
os.environ.setdefault("STEPBUNDLE_EXPORT_CHECK", "0")

# Tests compile at XLA's lowest LLVM code-generation effort: most of a test's processor
# time is XLA:CPU compiling programs that then run for a few steps, and LLVM at -O0
# compiles them faster (tests/runtime/test_runtime_cli.py + test_layouts.py: 103.5 s ->
# 74.0 s of processor time). XLA's own HLO passes all still run, but the numbers can
# move beyond rounding (the two cases below), so the tests of the product's own numbers
# run at the defaults. This is a setting of the tests only: the product's defaults are
# unchanged. Appended to any
# XLA_FLAGS already set, before torch_xla and jaxlib read them (once per process); child
# processes inherit it. STEPBUNDLE_TEST_FAST_COMPILE=0 turns it off. The files in
# DEFAULT_COMPILE assert what the product's default compile computes: a session that
# collects any of them takes the flag back out before jax starts (see
# pytest_collection_modifyitems), and scripts/test.sh runs them in sessions of their own.
# test_layouts: at -O0 on jax 0.7.1, fsdp+tp on four devices ended 1.054e-5 (normwise,
# transformer.h.0.mlp.c_proj.weight) from one device, over docs/parallel.md's 1e-5 bound
# for the product's compile; its sessions run at the defaults, as a user's would.
DEFAULT_COMPILE = ("runtime/test_cpu_numerics.py", "runtime/test_layouts.py")
# Files whose child processes (the bundle's runs in the lean environment) must compile at
# the product's defaults: under -O0 the resnet18 bundle's conv1.weight momentum ends
# 1.6e-3 (normwise) from PyTorch float64, against 1.2e-5 at the defaults and 2.0e-5 for
# PyTorch float32: -O0 moves these numbers, so their comparisons run as a user's would.
# The pytest process itself (torch_xla eager, the export) stays at -O0. (Children started
# by a module-scoped fixture, before this fixture runs, build their environment with
# fast_compile.without_fast_compile themselves: tests/exporter/test_training_job.py.)
DEFAULT_COMPILE_CHILDREN = ("equivalence/test_equiv_heavy.py",)
FAST_COMPILE_ON = os.environ.get("STEPBUNDLE_TEST_FAST_COMPILE", "1").strip() != "0"
if FAST_COMPILE_ON:
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *FAST_COMPILE]).strip()

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "default_compile: asserts what the product's default XLA compile computes; its "
        "session runs without the tests' fast-compile flag (tests/conftest.py)",
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '(unset)')}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks DEFAULT_COMPILE's tests; if any is collected, the session's XLA_FLAGS lose
    the fast-compile flag before any test runs: jaxlib reads XLA_FLAGS once, when its
    backend starts (after collection), and children read what this process holds then.
    torch_xla read them at import and keeps -O0; these tests do not use it."""
    tests = Path(__file__).resolve().parent
    marked = False
    for item in items:
        if any(item.path == tests / name for name in DEFAULT_COMPILE):
            item.add_marker(pytest.mark.default_compile)
            marked = True
    if not (marked and FAST_COMPILE_ON):
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise pytest.UsageError(
            "jax's backend started during collection, under the tests' fast-compile "
            "XLA_FLAGS, and this session collected tests that need the default compile "
            f"({', '.join(DEFAULT_COMPILE)}): run those in a session of their own, or set "
            "STEPBUNDLE_TEST_FAST_COMPILE=0."
        )
    flags = without_fast_compile(os.environ.get("XLA_FLAGS", ""))
    if flags:
        os.environ["XLA_FLAGS"] = flags
    else:
        os.environ.pop("XLA_FLAGS", None)


@pytest.fixture(autouse=True)
def _default_compile_children(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEFAULT_COMPILE_CHILDREN's tests start their children without the -O0 flag."""
    tests = Path(__file__).resolve().parent
    if not any(request.node.path == tests / name for name in DEFAULT_COMPILE_CHILDREN):
        return
    flags = without_fast_compile(os.environ.get("XLA_FLAGS", ""))
    if flags:
        monkeypatch.setenv("XLA_FLAGS", flags)
    else:
        monkeypatch.delenv("XLA_FLAGS", raising=False)


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
    """Tests never share the user's compile cache: they share one of their own, a folder
    per pytest session, reached the way a user's load reaches the default one
    ($STEPBUNDLE_CACHE_DIR, inherited by child processes). A program compiled by one test
    is a verified hit for the next (the hit computes the compiled executable's numbers:
    tests/runtime/test_cache_integrity.py). Tests of the cache itself, and of compile
    counts or a cache that is off, pass their own ``cache_dir`` (a tmp_path, or False)."""
    monkeypatch.setenv("STEPBUNDLE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "xla-cache"))


@pytest.fixture(scope="session")
def example_bundle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``example_bundle(stem)``: ``stepbundle export examples/<stem>.py:recipe`` run once per
    session in a child process (the export environment's python), as a user runs it;
    the bundle's path and the export's wall seconds. Tests that export the same example
    share it (test_export_examples.py, test_training_job.py)."""
    import subprocess
    import time

    folder = tmp_path_factory.mktemp("examples")
    done: dict[str, tuple[Path, float]] = {}

    def get(stem: str) -> tuple[Path, float]:
        if stem not in done:
            bundle = folder / f"{stem}.stepbundle"
            recipe = f"{ROOT / 'examples' / stem}.py:recipe"
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-m", "stepbundle", "export", recipe, "-o", str(bundle)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert out.returncode == 0, out.stderr
            done[stem] = bundle, time.perf_counter() - t0
        return done[stem]

    return get
