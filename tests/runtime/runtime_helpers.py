"""Helpers for the runtime tests: golden bundles, their inputs and expected outputs.

No torch here: these tests also run in the lean environment.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime.train.batches import iter_batches


def cli_here(*args: str) -> Any:
    """tests/cli_here.py's in-process CLI run, imported on first use: the children that import this
    module (hostile_writer_child, dp_child, benchmarks/device/check.py) put only tests/runtime on
    their path, not tests/."""
    tests = str(Path(__file__).resolve().parent.parent)
    if tests not in sys.path:
        sys.path.append(tests)
    from cli_here import cli_here as run

    return run(*args)


GOLDEN_ROOT = Path(__file__).resolve().parent.parent / "golden"
"""Golden files, one folder per format version (``v1.0``, ...): written once by
tests/golden/make_golden.py when that version is made, never regenerated."""

_GOLDEN_FOLDER = re.compile(r"v(\d+)\.(\d+)\Z")


def drain_terminal(controller: int) -> bytes:
    """Everything a child wrote to the pseudo-terminal whose controller end this is, up
    to the child closing it; closes the controller."""
    received = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the child closed the terminal (EIO)
            break
        if not chunk:
            break
        received += chunk
    os.close(controller)
    return received


def golden_folder_name(version: tuple[int, int]) -> str:
    """``(1, 0)`` -> ``"v1.0"``: the folder of that format version's golden files."""
    return f"v{version[0]}.{version[1]}"


def golden_versions() -> tuple[tuple[int, int], ...]:
    """Every format version that has a golden folder, oldest first."""
    found = []
    for p in GOLDEN_ROOT.iterdir():
        m = _GOLDEN_FOLDER.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), int(m.group(2))))
    if not found:
        raise FileNotFoundError(f"{GOLDEN_ROOT} has no golden folder (v<major>.<minor>).")
    return tuple(sorted(found))


def golden_dir(version: tuple[int, int] | None = None) -> Path:
    """The folder of ``version``'s golden files; the newest version's when None."""
    return GOLDEN_ROOT / golden_folder_name(version or golden_versions()[-1])


def golden_names(version: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The names of ``version``'s golden bundles (the newest version's when None)."""
    found = golden_dir(version).glob("*.stepbundle")
    return tuple(sorted(p.name.removesuffix(".stepbundle") for p in found))


GOLDEN_DIR = golden_dir()  # the newest format version's golden files
GOLDEN_NAMES = ("linear_adamw", "dropout_sgd", "batchnorm_lr")
GOLDEN_STEPS = {"linear_adamw": 5, "dropout_sgd": 5, "batchnorm_lr": 6}
GOLDEN_SCHEDULES = {"batchnorm_lr": "warmup_cosine:peak=0.02,warmup=2,total=6,min=0.001"}


def golden_bundle(name: str, version: tuple[int, int] | None = None) -> Path:
    """Golden bundle ``name`` of format ``version`` (the newest when None)."""
    return golden_dir(version) / f"{name}.stepbundle"


def golden_batches(
    name: str, version: tuple[int, int] | None = None
) -> list[dict[str, np.ndarray]]:
    with np.load(golden_dir(version) / f"{name}.inputs.npz", allow_pickle=False) as z:
        return iter_batches({k: z[k] for k in z.files})


def golden_expected(name: str, version: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    with np.load(golden_dir(version) / f"{name}.expected.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def rel(a: np.ndarray, b: np.ndarray, floor: float = 1e-6) -> float:
    """max|a-b| / max(max|b|, floor): the tensor's relative error at its own scale."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), floor)


def golden_train_module(name: str) -> Any:
    """The golden bundle ``name``'s first train program, parsed (a module to rewrite, or
    whose MLIR context parses a test's own StableHLO text)."""
    from stepbundle.schema.reader import open_bundle
    from stepbundle.stablehlo import artifact as mlir

    with open_bundle(golden_bundle(name)) as b:
        program = b.manifest.entries["train"].programs[0]
        return mlir.parse_artifact(bytes(b.section(program.section)))


def run_on_cpu(module: Any, *args: np.ndarray) -> list[np.ndarray]:
    """Compile ``module`` for the CPU as it is (no runtime rewrites) and run it once."""
    import jax

    from stepbundle.runtime import _compat

    client = _compat.get_client("cpu")
    device = client.local_devices()[0]
    exe = _compat.compile_bytecode(
        client, module.bytecode(), [device], _compat.compile_options(1, [device.id])
    )
    return [np.asarray(o) for o in exe.execute([jax.device_put(a, device) for a in args])]


def lease_granted(folder: Path) -> bool:
    """Whether this process gets a read lease on a file of its own in ``folder`` (Linux,
    a file system with leases): where it does, dataset shards are memory-mapped under one
    (runtime/data/shard_file.py); elsewhere they are read with pread."""
    if sys.platform != "linux":
        return False
    import fcntl
    import os

    probe = folder / ".lease-probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, 23)  # SIGURG: no SIGIO if the lease broke now
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()
