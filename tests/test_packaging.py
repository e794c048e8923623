"""A non-editable install works from the checkout root: nothing in the checkout shadows it.

The wheel is built from a copy of the checkout, installed into a fresh virtual environment
with no stepbundle on its path, and used from the checkout root, where a top-level folder
named ``stepbundle`` (there was one) would win over the installed package: it imports,
inspects a golden bundle and trains it for two steps (the runtime, jaxlib's MLIR and the
package data, all from the wheel). The fresh environment borrows the lean environment's
third-party packages (jax, numpy, msgpack) through a ``.pth`` line; that line adds the
folder to ``sys.path`` without running the lean environment's own ``.pth`` files, so the
lean environment's editable install of stepbundle stays out of it. The oracle: before the
wheel goes in, ``import stepbundle`` fails in that environment, from the checkout root too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def newest_golden_folder(root: Path = ROOT / "tests" / "golden") -> Path:
    """The golden folder of the newest format version, by number (``v1.10`` after ``v1.2``)."""
    found = {}
    for folder in root.iterdir():
        m = re.fullmatch(r"v(\d+)\.(\d+)", folder.name)
        if m and folder.is_dir():
            found[(int(m.group(1)), int(m.group(2)))] = folder
    return found[max(found)]


GOLDEN_FOLDER = newest_golden_folder()
GOLDEN = GOLDEN_FOLDER / "linear_adamw.stepbundle"
GOLDEN_INPUTS = GOLDEN_FOLDER / "linear_adamw.inputs.npz"
GOLDEN_EXPECTED = GOLDEN_FOLDER / "linear_adamw.expected.npz"


def _lean_site_packages(lean_python: str) -> str:
    out = subprocess.run(
        [lean_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@dataclass(frozen=True)
class FreshEnv:
    """The fresh environment with the wheel installed, and what it said before the wheel."""

    python: Path
    before_at_root: subprocess.CompletedProcess[str]
    """``import stepbundle`` from the checkout root, before the wheel was installed."""
    before_elsewhere: subprocess.CompletedProcess[str]
    """The same from ``/``."""


_IMPORT = "import stepbundle; print(stepbundle.__file__)"


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory: pytest.TempPathFactory, lean_python: str) -> FreshEnv:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "tests", "benchmarks", "__pycache__"
        ),
    )
    subprocess.run(
        [lean_python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (work / "dist").glob("stepbundle-*.whl")
    env_dir = work / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "borrowed_lean_packages.pth").write_text(
        _lean_site_packages(lean_python) + "\n"
    )
    # The oracle, taken before the wheel goes in: no stepbundle anywhere on this path.
    before_at_root = _run(python, ROOT, "-c", _IMPORT)
    before_elsewhere = _run(python, Path("/"), "-c", _IMPORT)
    subprocess.run(
        [
            lean_python,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return FreshEnv(python, before_at_root, before_elsewhere)


@pytest.fixture(scope="module")
def installed_python(fresh_env: FreshEnv) -> Path:
    return fresh_env.python


def _run(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # No PYTHONPATH: nothing but the environment itself decides what imports.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _run_at_root(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _run(python, ROOT, *args)


def test_installed_package_imports_from_the_checkout_root(installed_python: Path) -> None:
    result = _run_at_root(
        installed_python,
        "-c",
        "import stepbundle, stepbundle.runtime, stepbundle.schema, stepbundle.stablehlo.artifact;"
        "import stepbundle.cli; print(stepbundle.__file__); print(stepbundle.runtime.__file__)",
    )
    assert result.returncode == 0, result.stderr
    purelib = sysconfig.get_paths(vars={"base": str(installed_python.parent.parent)})["purelib"]
    files = result.stdout.split()
    assert len(files) == 2
    for f in files:
        # Both come from the fresh environment, not from folders of the checkout.
        assert Path(f).resolve().is_relative_to(Path(purelib).resolve()), (f, purelib)


def test_python_dash_m_stepbundle_from_the_checkout_root(installed_python: Path) -> None:
    result = _run_at_root(installed_python, "-m", "stepbundle", "inspect", str(GOLDEN))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("bundle ")
    assert "entry 'train'" in result.stdout
    version = _run_at_root(installed_python, "-m", "stepbundle", "--version")
    assert version.returncode == 0, version.stderr
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version.stdout.strip() == f"stepbundle {declared}"


def test_the_wheel_trains_a_golden_bundle_from_the_checkout_root(
    installed_python: Path,
) -> None:
    result = _run_at_root(
        installed_python,
        "-m",
        "stepbundle",
        "run",
        str(GOLDEN),
        "--data",
        str(GOLDEN_INPUTS),
        "--steps",
        "2",
        "--no-cache",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    got = np.array([line["loss"] for line in lines])
    want = np.load(GOLDEN_EXPECTED)["metric/loss"][:2]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_the_fresh_environment_had_no_stepbundle_before_the_wheel(fresh_env: FreshEnv) -> None:
    # The oracle for the tests above: before the wheel went in, this environment could not
    # import stepbundle, from the checkout root or elsewhere, so they could not have
    # passed through a path leak from the lean environment or the checkout.
    for before in (fresh_env.before_at_root, fresh_env.before_elsewhere):
        assert before.returncode != 0, before.stdout
        assert "ModuleNotFoundError: No module named 'stepbundle'" in before.stderr
    # The borrowed packages were there all along: the failure was stepbundle's absence.
    jax = _run(fresh_env.python, Path("/"), "-c", "import jax, msgpack, numpy")
    assert jax.returncode == 0, jax.stderr
    # And after it, stepbundle comes from the wheel in the fresh environment.
    after = _run(fresh_env.python, Path("/"), "-c", _IMPORT)
    assert after.returncode == 0, after.stderr
    assert "site-packages/stepbundle/__init__.py" in after.stdout
    assert str(ROOT) not in after.stdout
    assert sys.executable != str(fresh_env.python)


def test_the_newest_golden_folder_is_chosen_by_number(tmp_path: Path) -> None:
    for name in ("v1.2", "v1.10", "v1.9", "v0.30", "notes"):
        (tmp_path / name).mkdir()
    assert newest_golden_folder(tmp_path).name == "v1.10"
