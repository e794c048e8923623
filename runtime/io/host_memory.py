"""How much host memory this process could still allocate: what a reader checks a
requested batch against before allocating it, so an impossible size is a refusal rather
than a ``MemoryError`` traceback, an OOM kill or minutes of swapping.

Imports: the standard library only.
"""

from __future__ import annotations

import resource

__all__ = ["available_bytes", "format_bytes"]


def _proc_kib(path: str, key: str) -> int | None:
    """A ``Key:   123 kB`` value of a /proc file, in bytes (None where there is none)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes() -> int | None:
    """The bytes this process could allocate now: the least of the system's available
    memory (``MemAvailable`` plus free swap) and what is left under ``RLIMIT_AS`` and
    ``RLIMIT_DATA``. None when none of them is known (not Linux, no limits)."""
    found: list[int] = []
    avail = _proc_kib("/proc/meminfo", "MemAvailable")
    if avail is not None:
        found.append(avail + (_proc_kib("/proc/meminfo", "SwapFree") or 0))
    for limit, used_key in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft, _ = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY:
            found.append(max(0, soft - (_proc_kib("/proc/self/status", used_key) or 0)))
    return min(found) if found else None


def format_bytes(n: int) -> str:
    """``7.3 TiB``, ``512 MiB``, ``96 B``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
