"""benchmarks/device/trace_ops.py sums a real jax profiler trace by operation (here a CPU
trace; on a TPU the same file format carries the device's XLA operations)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.profiler
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "device" / "trace_ops.py"


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("trace_ops", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_traced_program_is_summed_by_operation(tmp_path: Path) -> None:
    f = jax.jit(lambda a, b: jnp.tanh(a @ b).sum())
    a = jnp.ones((256, 256))
    f(a, a).block_until_ready()
    jax.profiler.start_trace(str(tmp_path))
    for _ in range(4):
        f(a, a).block_until_ready()
    jax.profiler.stop_trace()
    rows = _module().summarize(tmp_path, top=50)
    assert rows and all(r["total_ms"] >= 0 for r in rows)
    assert rows == sorted(rows, key=lambda r: -r["total_ms"])
    # The jitted function's dispatches are in it, four of them.
    dispatch = [r for r in rows if r["op"].startswith("PjitFunction")]
    assert dispatch and dispatch[0]["count"] >= 4


def test_a_folder_without_a_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="trace.json.gz"):
        _module().summarize(tmp_path)
