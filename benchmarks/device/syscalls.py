"""What the system calls an allocator makes cost on this host (a sandbox shows here).

    python benchmarks/device/syscalls.py --out syscalls.json

``getppid`` (a call that does nothing), a 1 MB anonymous ``mmap`` touched on two pages
and unmapped (what glibc does for a large block it frees), and a 1 MB ``bytearray``
(glibc's malloc and free as Python uses them), each averaged over many calls. The TPU
host this project measures on runs under gVisor, where these cost several times what
they cost on the CPU machine (``runtime/compile/allocator.py`` has both).

Imports: the standard library.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path


def per_call_us(f: Callable[[], object], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def _map_touch_unmap() -> None:
    m = mmap.mmap(-1, 1 << 20)
    m[0] = 1
    m[4096 * 100] = 1
    m.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    report = {
        "uname": " ".join(platform.uname()),
        "getppid_us": per_call_us(os.getppid, 200_000),
        "mmap_touch_munmap_1mb_us": per_call_us(_map_touch_unmap, 20_000),
        "bytearray_1mb_us": per_call_us(lambda: bytearray(1 << 20), 20_000),
    }
    print(json.dumps(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
