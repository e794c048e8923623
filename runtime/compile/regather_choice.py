"""Whether a fully sharded program needs the ``regather-weights`` rewrite: XLA's memory
analysis against the device's memory, and a compile refused for memory.

The rewrite (``stablehlo/regather.py``) gives each later product of a split parameter its
own copy, so that the partitioner gathers the weight again for the backward pass. It is
what made the 8B of docs/parallel.md fit a v5e-256 (libtpu refused the program as
written at 16.22 GiB a chip; 14.09 with the rewrite), and it costs memory elsewhere: the
1.1B on a v5e-8 needs more with it than without (docs/parallel.md, the results file
``benchmarks/results/parallel_offline-v5e.json``). So under ``regather_weights="auto"``
``compile_program`` compiles the program as written first, and the rewritten one only
where the first does not fit: libtpu refused it for memory (``memory_refusal``), or XLA's
plan of one device's memory (``memory_need``) exceeds what the device holds
(``CompileOptions.device_memory``, else ``device_memory``). Where both were compiled
because of the plan, the rewritten one is kept unless its plan needs more.

Imports: the runtime's _compat.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .. import _compat

__all__ = ["device_memory", "gib", "memory_need", "memory_refusal"]

_REFUSAL = re.compile(r"RESOURCE_EXHAUSTED:\s*(.*)", re.S)
_REPORT = "Memory usage report"  # libtpu's buffer listing follows its message
_RAN_OUT = "Ran out of memory"


def memory_need(executable: Any) -> int | None:
    """The bytes one device holds at the program's peak, from XLA's memory analysis
    (``get_compiled_memory_stats``): arguments + outputs - the outputs aliased to donated
    arguments + temporaries + generated code, as ``benchmarks/device/compile_slices.py``
    reports it. None where the executable has no analysis."""
    try:
        m = executable.get_compiled_memory_stats()
        return int(
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes
            + m.generated_code_size_in_bytes
        )
    except Exception:  # a plugin or executable without the analysis: nothing to weigh
        return None


def device_memory(devices: Sequence[Any]) -> int | None:
    """The bytes a program may use on each of ``devices``: the least ``bytes_limit`` that
    their ``memory_stats()`` report (a TPU's or a GPU's). None where none reports one (a
    CPU; the compile-only devices of a described TPU slice, where libtpu's own refusal
    is the test)."""
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # a described device: no runtime to ask
            continue
        limit = stats.get("bytes_limit") if isinstance(stats, dict) else None
        if isinstance(limit, int) and limit > 0:
            limits.append(limit)
    return min(limits) if limits else None


def memory_refusal(error: BaseException) -> str | None:
    """What the compiler said, where ``error`` is a compile refused for memory: a
    ``JaxRuntimeError`` of status RESOURCE_EXHAUSTED, or one that says it ran out of
    memory (libtpu refuses a program that does not fit a chip's HBM: "XLA:TPU compile
    permanent error. Ran out of memory in memory space hbm. Used 16.22G of 15.75G hbm.");
    None for any other error."""
    if not isinstance(error, _compat.JaxRuntimeError):
        return None
    text = str(error)
    found = _REFUSAL.search(text)
    if found is None and _RAN_OUT not in text:
        return None
    words = " ".join((found.group(1) if found else text).split(_REPORT)[0].split())
    return (words[:297] + "...") if len(words) > 300 else words or "RESOURCE_EXHAUSTED"


def gib(n: int) -> str:
    """``n`` bytes in words: GiB as the docs give them (MiB, or bytes, for the small
    programs of the tests)."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n:,} bytes"
