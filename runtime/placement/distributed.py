"""Joining a multi-process job: one process per host (or per GPU), one bundle.

A data-parallel run over devices on several hosts starts the same command on every
host. Each process calls ``initialize`` before ``load``; ``jax.distributed`` then
connects them through a coordinator (process 0's address), every process sees the
devices of the whole job, and ``ParallelOptions(devices=...)`` compiles one SPMD program across
them. XLA's collectives go over the platform's own links (NCCL on GPUs, ICI on TPUs,
gloo over TCP on CPUs).

On TPU pods and under SLURM or Open MPI, jax finds the coordinator and the process's
rank itself: call ``initialize()`` without arguments.

Imports: jax.
"""

from __future__ import annotations

from typing import Any

__all__ = ["agree", "initialize", "process_id", "set_cpu_devices"]


def set_cpu_devices(n: int) -> None:
    """Give this process ``n`` virtual CPU devices (before jax's first device query).

    Raises ``PlatformError`` when jax's CPU backend is already running.
    """
    import jax

    from ..errors import PlatformError

    try:
        config: Any = jax.config
        config.update("jax_num_cpu_devices", int(n))
    # RuntimeError: jax's backends already started. AttributeError: this jax has no such
    # option. ValueError, TypeError: ``n`` is not a count.
    except (RuntimeError, AttributeError, ValueError, TypeError) as e:
        raise PlatformError(
            f"Cannot give this process {n} CPU devices now ({e}). Set it before the first "
            f"jax call, or start Python with XLA_FLAGS=--xla_force_host_platform_device_count={n}."
        ) from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices: int | None = None,
    timeout_s: int = 300,
) -> None:
    """Join the job: process ``process_id`` of ``num_processes``, coordinated at
    ``coordinator_address`` ("host:port" of process 0).

    ``cpu_devices`` gives each process that many virtual CPU devices (for CPU runs and
    tests). Call it once, before ``load``.
    """
    import jax

    from ..errors import PlatformError

    if cpu_devices is not None:
        set_cpu_devices(cpu_devices)
    kwargs: dict[str, Any] = {}
    if timeout_s:
        kwargs["initialization_timeout"] = int(timeout_s)
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    # RuntimeError (JaxRuntimeError among them): called too late or twice, or the
    # coordinator was unreachable. ValueError: arguments jax could not complete itself.
    except (RuntimeError, ValueError) as e:
        raise PlatformError(
            f"Could not join the multi-process job ({e}). Every process needs the same "
            "coordinator address (process 0's host:port, reachable from all hosts) and the "
            "same process count, and a distinct process id from 0 to count-1."
        ) from None


def agree(ok: bool, *, timeout_s: float = 3600.0) -> bool:
    """True when every process of the job passes ``ok=True`` (True outside a job).

    Every process calls it at the same point, with whether its own part succeeded, so
    that one process's failure stops the others instead of leaving them waiting in the
    next collective. Raises ``PlatformError`` when a process does not answer in time.
    """
    from .. import _compat
    from ..errors import PlatformError

    try:
        answer = _compat.job_agree(ok, timeout_s)
    except TimeoutError as e:
        raise PlatformError(f"The multi-process job stopped answering: {e}.") from None
    return ok if answer is None else answer


def process_id() -> int:
    """This process's rank in the job ``initialize`` joined; 0 outside a job."""
    from .. import _compat

    return _compat.job_process_id()
