"""A short soak: stepping a bundle many times does not grow the process's memory.

The long version, with its figures, is ``benchmarks/soak.py`` (10,000 steps). This one
runs the same loop for 1,500 steps after a warm-up and bounds the growth of the resident
set size. Measured here the growth is below 100 KiB; keeping each step's metrics (what
``Trainer.run``'s returned list does, about 6 KB a step) shows as about 9 MB, well past
the bound.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from runtime_helpers import GOLDEN_NAMES

ROOT = Path(__file__).resolve().parent.parent.parent
GROWTH_LIMIT = 4 * 1024 * 1024


def _soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "stepbundle_soak", ROOT / "benchmarks" / "soak.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS (Linux)")
@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_stepping_does_not_grow_memory(name: str) -> None:
    r = _soak_module().soak(name, steps=1500, warmup=300, sync_every=50)
    assert r["losses_finite"]
    assert r["step_count"] == 1800
    assert r["growth_after_warmup"] < GROWTH_LIMIT, r
