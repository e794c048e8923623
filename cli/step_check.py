"""One step of a bundle on the CPU, for the export check (``stepbundle.frontend.step_check``).

``python -m stepbundle.cli.step_check BUNDLE BATCH OUT [--initial]`` loads ``BUNDLE``
with the runtime on the CPU (train entry only, no compile cache), steps it once from its
initial state (``--init-from FILE``: a bundle without weights takes its parameters and
buffers from the exporting model's, written there) with the batch in ``BATCH`` (a
safetensors file, one tensor per batch key) and writes, into the folder ``OUT``:

- ``after.safetensors``: the state after the step under its state names (every name of
  a tied tensor), a plain safetensors file;
- ``metrics.json``: each metric as ``{"shape": [...], "values": [...]}`` (float64);
- ``seconds.json``: load (compile included), step and write times, and the load's parts
  (``load.open``, ``load.compile``, ``load.state``: ``LoadInfo.seconds``).

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
from pathlib import Path

__all__ = ["main"]

# The check runs the program once: compile it fast. These set LLVM's effort only (XLA's
# own passes, which decide what is computed, all run); on resnet18's train program the
# CPU compile took 14 s instead of 46 (wall, on a shared 2-core machine), and the state
# moved by 2e-5 of its largest value at most (rounding), far inside the check's bounds
# (the update within 1e-3, plus 4 float32 roundings of the value). Both jaxlibs the
# project supports (0.7.1, 0.10.2) know them. The runtime itself turns YNNPACK's fusions
# off on the CPU (CompileOptions, #39 item 5).
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def _fast_compile() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in _FAST_COMPILE if f.split("=")[0] not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepbundle.cli.step_check")
    parser.add_argument("bundle")
    parser.add_argument("batch")
    parser.add_argument("out")
    parser.add_argument("--init-from")
    args = parser.parse_args(argv)
    _fast_compile()

    import numpy as np

    from stepbundle.runtime import CompileOptions, LoadOptions, StateOptions, load
    from stepbundle.runtime.io.tensor_file import open_safetensors
    from stepbundle.runtime.state.checkpoint import write_safetensors

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
    # The state alone, as a plain safetensors file: the parent reads it once, from this
    # machine, right away. A checkpoint (save_checkpoint) would also copy every tensor
    # from the device a second time for its SHA-256 digest (what that costs:
    # benchmarks/results/export_check_choices.md).
    write_safetensors(out / "after.safetensors", trainer.state_dict())
    t3 = time.perf_counter()
    values = {}
    for name, v in metrics.items():
        a = np.asarray(v).astype(np.float64)
        values[name] = {"shape": list(a.shape), "values": a.reshape(-1).tolist()}
    (out / "metrics.json").write_text(json.dumps(values))
    seconds = {"load": t1 - t0, "step": t2 - t1, "write": t3 - t2}
    seconds.update({f"load.{k}": v for k, v in trainer.load_info.seconds.items()})
    (out / "seconds.json").write_text(json.dumps(seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
