"""One step of a bundle on the CPU, for the export check (``stepbundle.frontend.step_check``).

``python -m stepbundle.cli.step_check BUNDLE BATCH OUT [--initial]`` loads ``BUNDLE``
with the runtime on the CPU (train entry only, no compile cache), steps it once from its
initial state (``--init-from FILE``: a bundle without weights takes its parameters and
buffers from the exporting model's, written there) with the batch in ``BATCH`` (a
safetensors file, one tensor per batch key) and writes, into the folder ``OUT``:

- ``after.safetensors``: the state after the step (``Trainer.save_checkpoint``);
- ``metrics.json``: each metric as ``{"shape": [...], "values": [...]}`` (float64);
- ``seconds.json``: load (compile included) and step times.

The front-ends run it in a child process: they may not import the runtime
(``tests/test_layering.py``), and the runtime needs jax's 64-bit mode, which must not
change in the exporting process. It is not a user command (``stepbundle run`` is).

Imports: the runtime, numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path

__all__ = ["main"]

# jax 0.10's CPU compiler hands a training program's reductions, convolutions and
# matmuls to YNNPACK, which drifts far more than float32 rounding (DESIGN.md: resnet18,
# 4.3e-4 from float64 after one step; 1.3e-6 without). The flag is unknown to older
# jaxlibs, which abort on it.
_YNN_OFF = "--xla_cpu_experimental_ynn_fusion_type="


def _jaxlib_at_least(major: int, minor: int) -> bool:
    try:
        parts = metadata.version("jaxlib").split(".")[:2]
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (metadata.PackageNotFoundError, ValueError):
        return False


def _quiet_cpu_compiler() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "ynn" not in flags and _jaxlib_at_least(0, 10):
        os.environ["XLA_FLAGS"] = f"{flags} {_YNN_OFF}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepbundle.cli.step_check")
    parser.add_argument("bundle")
    parser.add_argument("batch")
    parser.add_argument("out")
    parser.add_argument("--init-from")
    args = parser.parse_args(argv)
    _quiet_cpu_compiler()

    import numpy as np

    from stepbundle.runtime import CompileOptions, LoadOptions, StateOptions, load
    from stepbundle.runtime.io.tensor_file import open_safetensors

    out = Path(args.out)
    t0 = time.perf_counter()
    options = LoadOptions(
        compile=CompileOptions(entries=("train",), cache_dir=False),
        state=StateOptions(init_from=args.init_from, init_strict=False),
    )
    trainer = load(args.bundle, "cpu", options)
    t1 = time.perf_counter()
    with open_safetensors(args.batch) as f:
        batch = {name: np.array(f.array(name)) for name in f.records}
    metrics = trainer.step(batch)
    trainer.block_until_ready()
    t2 = time.perf_counter()
    trainer.save_checkpoint(out / "after.safetensors")
    values = {}
    for name, v in metrics.items():
        a = np.asarray(v).astype(np.float64)
        values[name] = {"shape": list(a.shape), "values": a.reshape(-1).tolist()}
    (out / "metrics.json").write_text(json.dumps(values))
    (out / "seconds.json").write_text(json.dumps({"load": t1 - t0, "step": t2 - t1}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
