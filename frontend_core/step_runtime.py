"""The export check's runtime side: the bundle's first step, run by the runtime in a child
process (``python -m stepbundle.cli.step_check``) while the exporting process steps
eagerly, and the processor time the two take.

A child process because the front-ends may not import the runtime
(``tests/test_layering.py``) and the runtime needs jax's 64-bit mode; it runs on the CPU
(``JAX_PLATFORMS=cpu``) with ``XLA_FLAGS`` as the user set them, so the executable it
leaves in the compile cache is the one a later ``stepbundle run`` looks for.

Imports: torch, safetensors, stepbundle.schema.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from stepbundle.schema.manifest import Manifest

from .step_eager import _NO_CHECK, CheckCouldNotRun

__all__ = [
    "RuntimeStep",
    "children_cpu_time",
    "cpu_time",
    "scratch_dir",
    "without_torch_xla_flag",
]

_SHM = "/dev/shm"


def scratch_dir(manifest: Manifest) -> str | None:
    """Where the check's files go (the batch, a weights-free bundle's initial weights,
    the state after the runtime's step): ``/dev/shm`` (memory) where it has room for
    twice the bundle's state and the machine has four times that available, else the
    system's temporary folder (``None``).

    The files are written once and read once by the other process right away: on a
    disk they are written out (and synced) for nothing. Memory is the cheaper road
    (GPT-2 small's state, 1.5 GB: benchmarks/results/export_check_choices.md); a
    container's small ``/dev/shm`` (Docker's default is 64 MB) or a state that would
    crowd the machine's memory takes the disk. (An export killed mid-check leaves its
    folder behind, there as in the temporary folder, named ``stepbundle-check-*``.)
    """
    state = sum(e.spec.nbytes * (1 + len(e.aliases)) for e in manifest.state)
    try:
        free = shutil.disk_usage(_SHM).free
        available = _mem_available()
    except OSError:
        return None
    if free >= 2 * state + (64 << 20) and available >= 4 * state:
        return _SHM
    return None


def _mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes (0 where there is none)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


_TORCH_XLA_FLAG = "--xla_cpu_enable_fast_math=false"


def without_torch_xla_flag(env: dict[str, str]) -> None:
    """``XLA_FLAGS`` as the user set it: without the flag torch_xla appends at its import.

    The runtime's process compiles the train program into the compile cache that a later
    ``stepbundle run`` reads, keyed by ``XLA_FLAGS`` among the rest; a run started from a
    shell has no such flag, and would not find the executable. The flag is XLA's own
    default (fast math off), so the executable is the same either way.
    """
    if "torch_xla" not in sys.modules or "XLA_FLAGS" not in env:
        return
    flags = env["XLA_FLAGS"].split()
    if flags and flags[-1] == _TORCH_XLA_FLAG:  # torch_xla appends it when it is missing
        flags = flags[:-1]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        del env["XLA_FLAGS"]


class RuntimeStep:
    """The runtime's process, stepping the bundle while this process steps eagerly (the
    two overlap: the check costs about the longer of them, not their sum).

    ``RuntimeStep()`` starts it at once: it starts Python and imports the runtime (jax),
    then waits for its bundle on its standard input, so a front-end can start it before it
    traces (``step_check.runtime_ahead``) and the import runs while the export does.
    ``begin`` hands it the bundle; ``wait`` waits for its step; ``stop`` ends it where
    nothing is handed over or its step is no longer wanted.
    """

    def __init__(self) -> None:
        env = dict(os.environ)
        env["JAX_PLATFORMS"] = "cpu"
        without_torch_xla_flag(env)
        # Its output, read back only where it fails (a file: a pipe nobody reads while
        # it runs could fill up and stop it).
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by wait() or stop()
        self._t0 = time.perf_counter()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "stepbundle.cli.step_check", "--wait"],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def begin(
        self,
        path: Path,
        batch: Mapping[str, torch.Tensor],
        work: Path,
        init: Mapping[str, torch.Tensor],
    ) -> None:
        """Hand it the bundle at ``path``: the batch and (a bundle without weights) the
        initial weights are written into ``work``, where it writes the state after its
        step (``python -m stepbundle.cli.step_check``)."""
        from safetensors.torch import save_file

        batch_file = work / "batch.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in batch.items()}, str(batch_file))
        job = {"bundle": str(path), "batch": str(batch_file), "out": str(work)}
        if init:
            init_file = work / "init.safetensors"
            save_file({k: v.contiguous() for k, v in init.items()}, str(init_file))
            job["init_from"] = str(init_file)
        self._t0 = time.perf_counter()
        stdin = self._proc.stdin
        assert stdin is not None
        # A process that already ended (it could not start) says why in wait().
        with contextlib.suppress(BrokenPipeError):
            stdin.write(json.dumps(job).encode() + b"\n")
        with contextlib.suppress(BrokenPipeError):
            stdin.close()

    def stop(self) -> None:
        """End the process where it still runs (no bundle was handed over, or the eager
        step failed); nothing of it is needed."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        self._log.close()

    def wait(self) -> float:
        """Wait for the process; its wall time since ``begin``.

        Raises:
          CheckCouldNotRun: it failed.
        """
        code = self._proc.wait()
        seconds = time.perf_counter() - self._t0
        if code != 0:
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace").strip()[-2000:]
            self._log.close()
            raise CheckCouldNotRun(
                f"The export check could not run the bundle's step on the CPU (the runtime's "
                f"process exited with {code}):\n{tail}\nIf the model is too big to step on "
                f"this machine's CPU, {_NO_CHECK}."
            )
        self._log.close()
        return seconds


def children_cpu_time() -> float:
    """Processor time of this process's finished children, in seconds."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def cpu_time() -> float:
    """Processor time of this process and its finished children, in seconds."""
    return time.process_time() + children_cpu_time()
