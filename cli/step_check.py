"""One step of a bundle on the CPU, for the export check (``stepbundle.frontend.step_check``).

``python -m stepbundle.cli.step_check BUNDLE BATCH OUT [--initial]`` loads ``BUNDLE``
with the runtime on the CPU (train entry only, compiled with the options and into the
compile cache ``stepbundle run`` uses by default, so that a run of the bundle on this
machine does not compile its train program again), steps it once from its
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


def _cpu_only() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepbundle.cli.step_check")
    parser.add_argument("bundle")
    parser.add_argument("batch")
    parser.add_argument("out")
    parser.add_argument("--init-from")
    args = parser.parse_args(argv)
    _cpu_only()

    import numpy as np

    from stepbundle.runtime import CompileOptions, LoadOptions, StateOptions, load
    from stepbundle.runtime.io.tensor_file import open_safetensors
    from stepbundle.runtime.state.checkpoint import write_safetensors

    out = Path(args.out)
    t0 = time.perf_counter()
    options = LoadOptions(
        # The train program compiled as ``stepbundle run`` compiles it on the CPU (XLA's
        # default effort, the default compile cache): a run of this bundle on this
        # machine then finds the executable in the cache instead of compiling it again.
        compile=CompileOptions(entries=("train",)),
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
