"""A non-editable install works from the checkout root: nothing in the checkout shadows it.

The wheel is built from a copy of the checkout, installed into a fresh virtual environment
with no stepbundle on its path, and used from the checkout root, where a top-level folder
named ``stepbundle`` (there was one) would win over the installed package. The fresh
environment borrows the lean environment's third-party packages (jax, numpy, msgpack)
through a ``.pth`` line; that line adds the folder to ``sys.path`` without running the
lean environment's own ``.pth`` files, so the lean environment's editable install of
stepbundle stays out of it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = sorted((ROOT / "tests" / "golden").rglob("linear_adamw.stepbundle"))[-1]


def _lean_site_packages(lean_python: str) -> str:
    out = subprocess.run(
        [lean_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory: pytest.TempPathFactory, lean_python: str) -> Path:
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
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "borrowed_lean_packages.pth").write_text(
        _lean_site_packages(lean_python) + "\n"
    )
    return python


def _run_at_root(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


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


def test_the_fresh_environment_has_no_editable_stepbundle(installed_python: Path) -> None:
    # The oracle for the two tests above: without the wheel there is no stepbundle, so
    # they could not have passed through a path leak from the lean environment.
    result = subprocess.run(
        [
            str(installed_python),
            "-c",
            "import importlib.util as u; print(u.find_spec('stepbundle').origin)",
        ],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "site-packages/stepbundle/__init__.py" in result.stdout
    assert str(ROOT) not in result.stdout
    assert sys.executable != str(installed_python)
