"""One step of a bundle on the CPU, for the export check (``stepbundle.frontend.step_check``).

``python -m stepbundle.cli.step_check BUNDLE BATCH OUT [--init-from FILE]`` loads ``BUNDLE``
with the runtime on the CPU (train entry only, compiled with the options and into the
compile cache ``stepbundle run`` uses by default, so that a run of the bundle on this
machine does not compile its train program again; on jaxlib before 0.10, fast and
without the cache: ``_FAST_COMPILE``), steps it once from its
initial state (``--init-from FILE``: a bundle without weights takes its parameters and
buffers from the exporting model's, written there) with the batch in ``BATCH`` (a
safetensors file, one tensor per batch key) and writes, into the folder ``OUT``:

- ``after.safetensors``: the state after the step under its state names (a tied
  tensor once, under its state-table name), a plain safetensors file;
- ``metrics.json``: each metric as ``{"shape": [...], "values": [...]}`` (float64);
- ``seconds.json``: load (compile included), step and write times, and the load's parts
  (``load.open``, ``load.compile``, ``load.state``: ``LoadInfo.seconds``).

``python -m stepbundle.cli.step_check --wait`` starts Python and imports the runtime, then
reads its job from its standard input: one line, ``{"bundle": ..., "batch": ..., "out":
..., "init_from": ...}`` (``init_from`` optional); an empty input ends it (the export
ended without a check). The front-ends start it so before they trace, and the import
runs while they export (``stepbundle.frontend.step_runtime.RuntimeStep``);
``seconds.json`` then also has ``wait``, the wall seconds it waited for its job.

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


# Where compiling at XLA's default effort costs far more than the step it saves, the check
# compiles its one program with LLVM's effort turned down (XLA's own passes, which decide
# what is computed, all run) and leaves nothing in the compile cache: on jaxlib 0.7.1 the
# check's process for resnet18 (the torch_xla front-end's bundle) took 39.7 s of processor
# time at the default effort and 13.0 s at this one; on jaxlib 0.10.2, 16.8 s and 15.1 s
# (benchmarks/results/export_check_choices.md). Remove with jaxlib 0.7 (the oldest the
# runtime supports).
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_COMPILE_AS_RUN_FROM = (0, 10)


def _compile_as_run() -> bool:
    """Whether this jaxlib compiles the train program as ``stepbundle run`` does (into the
    compile cache), or fast for the one step (``_FAST_COMPILE``, no cache)."""
    from importlib.metadata import version

    parts = []
    for part in version("jaxlib").split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= _COMPILE_AS_RUN_FROM


def _cpu_only(as_run: bool) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if not as_run:  # before jax starts: XLA reads its flags once per process
        flags = os.environ.get("XLA_FLAGS", "")
        extra = [f for f in _FAST_COMPILE if f.split("=")[0] not in flags]
        if extra:
            os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepbundle.cli.step_check")
    parser.add_argument("bundle", nargs="?")
    parser.add_argument("batch", nargs="?")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--init-from")
    parser.add_argument("--wait", action="store_true")
    args = parser.parse_args(argv)
    if not args.wait and args.out is None:
        parser.error("BUNDLE, BATCH and OUT are needed (or --wait)")
    as_run = _compile_as_run()
    _cpu_only(as_run)

    import numpy as np

    from stepbundle.runtime import CompileOptions, LoadOptions, StateOptions, load
    from stepbundle.runtime.io.tensor_file import open_safetensors
    from stepbundle.runtime.state.checkpoint import write_safetensors

    c1 = time.process_time()  # the start: waiting for the job below costs no processor time
    waited = 0.0
    if args.wait:
        t_wait = time.perf_counter()
        line = sys.stdin.readline()
        if not line.strip():
            return 0  # the export ended without handing a bundle over
        job = json.loads(line)
        args.bundle, args.batch, args.out = job["bundle"], job["batch"], job["out"]
        args.init_from = job.get("init_from")
        waited = time.perf_counter() - t_wait
    out = Path(args.out)
    t0 = time.perf_counter()
    options = LoadOptions(
        # The train program compiled as ``stepbundle run`` compiles it on the CPU (XLA's
        # default effort, the default compile cache): a run of this bundle on this
        # machine then finds the executable in the cache instead of compiling it again
        # (not on a jaxlib where that costs far more: _FAST_COMPILE).
        compile=CompileOptions(entries=("train",), cache_dir=as_run),
        state=StateOptions(init_from=args.init_from, init_strict=False),
    )
    trainer = load(args.bundle, "cpu", options)
    t1, c2 = time.perf_counter(), time.process_time()
    with open_safetensors(args.batch) as f:
        batch = {name: np.array(f.array(name)) for name in f.records}
    metrics = trainer.step(batch)
    trainer.block_until_ready()
    t2, c3 = time.perf_counter(), time.process_time()
    # The state alone, as a plain safetensors file: the parent reads it once, from this
    # machine, right away. A checkpoint (save_checkpoint) would also copy every tensor
    # from the device a second time for its SHA-256 digest, and state_dict() copies each
    # buffer to the host before it is written; on the CPU the buffers are written from
    # where they lie (copy=False: no step follows). What each costs:
    # benchmarks/results/export_check_choices.md.
    # A tied tensor is written once, under its state-table name: the parent reads no
    # other (GPT-2 small's tied embedding, 154 MB of its 1.66 GB).
    write_safetensors(
        out / "after.safetensors", trainer.state_dict(copy=False, include_aliases=False)
    )
    t3, c4 = time.perf_counter(), time.process_time()
    values = {}
    for name, v in metrics.items():
        a = np.asarray(v).astype(np.float64)
        values[name] = {"shape": list(a.shape), "values": a.reshape(-1).tolist()}
    (out / "metrics.json").write_text(json.dumps(values))
    seconds = {"load": t1 - t0, "step": t2 - t1, "write": t3 - t2, "wait": waited}
    seconds.update({f"load.{k}": v for k, v in trainer.load_info.seconds.items()})
    # Processor seconds by part: the interpreter's start and the imports (up to ``c1``),
    # load (compile included), step, write.
    seconds.update({"cpu.start": c1, "cpu.load": c2 - c1, "cpu.step": c3 - c2,
                    "cpu.write": c4 - c3})  # fmt: skip
    (out / "seconds.json").write_text(json.dumps(seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
