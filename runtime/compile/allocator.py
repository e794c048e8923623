"""glibc's allocator told to keep the memory it frees, before compiling for a TPU.

libtpu allocates through glibc's ``malloc`` (it links no allocator of its own), and XLA's
passes allocate and free a great deal: by default glibc gives freed memory back to the
operating system (``munmap`` of large blocks at once, trimming the heap's top past 128
KB), one system call each time. Where a system call is expensive that dominates the
compile. The TPU v5e host this project measures on runs under gVisor (``uname``:
"runsc"), where a system call costs about twenty times what it does on the CPU machine;
there a CNN's train program compiled twice as fast with freed memory kept, and on the
CPU machine the same settings change nothing measurable (docs/tpu.md,
"Compile time: a CNN's train program", has the figures).

``keep_freed_memory`` sets, once per process, what ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_TOP_PAD_`` would: blocks up to 32 MB come from
the heap, the heap is not trimmed until 2 GB of it are free, and it grows 512 MB at a time (address space; pages
count only once touched). The cost: memory a compile freed stays in the process for
later allocations instead of going back to the system. It must run **before the TPU
runtime starts**: set through ``mallopt`` after libtpu initialised, it changed nothing. ``load`` calls it before
it first asks jax for the TPU, unless ``CompileOptions.keep_freed_memory`` is False; it
does nothing where jax's backends have already started (a script that touched the TPU
before ``load``: call ``keep_freed_memory()`` first, or set the variables), where the
user configured the allocator (any ``MALLOC_*`` variable, or malloc tunables in
``GLIBC_TUNABLES``), where ``malloc`` is not glibc's (tcmalloc or jemalloc preloaded),
and on a C library without ``mallopt``. ``LoadInfo.kept_freed_memory`` says which. The
setting lasts for the rest of the process (also when the load then fails).

Whether ``load`` applies it is the user's choice or a measured rule, never silent:
``CompileOptions.keep_freed_memory`` True applies it, False never does, and "auto" (the
default; the environment variable ``STEPBUNDLE_KEEP_FREED_MEMORY`` set to 1, 0 or auto
overrides an "auto") applies it only where a system call is slow: ``decide`` times
``getppid`` and keeps freed memory when it costs at least ``SLOW_SYSCALL_US``. ``LoadInfo.allocator`` says what was decided
and why, with the figure measured.

Imports: the standard library (and, lazily, runtime._compat to ask jax whether its backends
started).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

__all__ = ["ENV", "SETTINGS", "SLOW_SYSCALL_US", "decide", "keep_freed_memory", "syscall_us"]

ENV = "STEPBUNDLE_KEEP_FREED_MEMORY"
SLOW_SYSCALL_US = 3.0
"""A ``getppid`` at least this slow (microseconds) makes "auto" keep freed memory:
between the CPU machines measured and the gVisor TPU host, where keeping it halved a
CNN's compile (docs/tpu.md has the figures)."""

# mallopt's parameter numbers (glibc's malloc.h) and the values set.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS: tuple[tuple[str, int, int], ...] = (
    ("mmap_threshold", _M_MMAP_THRESHOLD, 32 << 20),  # glibc's largest allowed
    ("trim_threshold", _M_TRIM_THRESHOLD, 2**31 - 1),  # mallopt takes an int
    ("top_pad", _M_TOP_PAD, 512 << 20),
)

_state: dict[str, bool] = {}


def _user_settings() -> bool:
    """Whether the user configured glibc's allocator: any ``MALLOC_*`` variable
    (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_ARENA_MAX``, ...) or malloc tunables in
    ``GLIBC_TUNABLES``."""
    return any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc." in (
        os.environ.get("GLIBC_TUNABLES", "")
    )


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed memory (see the module docstring); decided once per
    process. Returns whether it is in effect: False where the user configured the
    allocator, ``malloc`` is not glibc's (an allocator preloaded with ``LD_PRELOAD``), the
    C library has no ``mallopt``, or on the first call jax's backends had already started."""
    if "applied" not in _state:
        from .. import _compat

        _state["applied"] = not _compat.backends_started() and _apply()
    return _state["applied"]


def _address(function: Any) -> int | None:
    return ctypes.cast(function, ctypes.c_void_p).value


def _apply() -> bool:
    if _user_settings():
        return False
    try:
        process = ctypes.CDLL(None)
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    if _address(process.malloc) != _address(libc.malloc):
        return False  # another allocator serves malloc: glibc's settings would do nothing
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    results = [mallopt(param, value) for _, param, value in SETTINGS]  # every one, then judge
    return all(r == 1 for r in results)


def syscall_us(calls: int = 200, rounds: int = 5) -> float:
    """The median cost of one ``getppid`` system call here, in microseconds (1,000 calls
    timed)."""
    import statistics
    import time

    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            os.getppid()
        per_call.append((time.perf_counter_ns() - t0) / calls / 1000)
    return statistics.median(per_call)


def decide(setting: bool | str) -> tuple[bool, str]:
    """Apply (or not) ``setting`` (True, False or "auto"; see the module docstring) and
    return whether freed memory is kept, with the reason in words for ``LoadInfo``.

    Raises:
      BindingError: ``STEPBUNDLE_KEEP_FREED_MEMORY`` holds something other than 1, 0 or auto.
    """
    why = f"keep_freed_memory={setting!r}"
    env = os.environ.get(ENV, "").strip().lower()
    if env not in ("", "auto", "1", "0"):
        from ..errors import BindingError

        raise BindingError(f"{ENV} must be 1, 0 or auto, got {env!r}. Set it to one of those.")
    if setting == "auto" and env in ("1", "0"):
        setting, why = env == "1", f"{ENV}={env}"
    if setting is False:
        return False, f"left alone ({why})"
    if setting == "auto":
        cost = syscall_us()
        if cost < SLOW_SYSCALL_US:
            return False, (
                f"left alone: a system call costs {cost:.2f} us here, under the "
                f"{SLOW_SYSCALL_US:g} us at which keeping freed memory pays"
            )
        why = f"a system call costs {cost:.1f} us here, at least {SLOW_SYSCALL_US:g} us"
    if keep_freed_memory():
        return True, f"freed memory kept ({why})"
    return False, (
        f"left alone although asked ({why}): the allocator was configured by the user, is "
        "not glibc's, or jax's backends had already started"
    )
