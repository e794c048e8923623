"""examples/write_dataset.py writes a dataset the runtime's loader reads (needs torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from stepbundle.runtime.data.dataset import open_dataset
from stepbundle.runtime.data.loader import Loader

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "write_dataset.py"


def test_example_writes_a_cifar_sized_dataset(tmp_path: Path) -> None:
    out = tmp_path / "cifar"
    r = subprocess.run(
        [sys.executable, str(EXAMPLE), str(out), "2500"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "2500 rows" in r.stdout
    ds = open_dataset(out)
    assert [(s.name, s.dtype.name, s.shape) for s in ds.inputs] == [
        ("x", "uint8", (32, 32, 3)),
        ("y", "int64", ()),
    ]
    batch = next(Loader(ds, 100, seed=0))
    assert batch["x"].shape == (100, 32, 32, 3)
    np.testing.assert_array_equal(np.sort(ds.gather(np.arange(2500))["y"][:10]), np.arange(10))
