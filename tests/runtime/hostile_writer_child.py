"""A writer that stops mid-write and waits to be killed (run by test_hostile_crash.py).

    python hostile_writer_child.py MODE TARGET [CACHE_DIR]

It overwrites TARGET (a bundle or a checkpoint, by MODE) and, at a chosen point of the
write, prints READY on stdout and sleeps: the test then SIGKILLs it there, so "killed
mid-write" is a known point, not a race. The points:

- ``*-data``:    inside the data write, after the first part of the payload hit the disk
- ``*-fsync``:   the temp file is complete and about to be flushed to disk
- ``*-replace``: the temp file is complete and synced, about to be renamed onto TARGET

No torch: the tests that run it also run in the lean environment.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

from stepbundle.runtime import CompileOptions, LoadOptions

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BALLAST_BYTES = 48 * 1024 * 1024  # large enough to be written in several chunks
DATA_SIGNAL_AFTER = 20 * 1024 * 1024  # bytes of the bundle on disk before stopping


def stop_here(what: str) -> None:
    print(f"READY {what}", flush=True)
    time.sleep(600)  # killed long before this ends
    raise SystemExit("not killed")  # pragma: no cover


class StoppingFile:
    """A binary file that stops the process once ``max_bytes`` bytes have been written,
    or at the ``max_writes``-th write."""

    def __init__(self, f: Any, max_bytes: int, max_writes: int) -> None:
        self._f = f
        self._max_bytes = max_bytes
        self._max_writes = max_writes
        self._written = 0
        self._writes = 0

    def write(self, data: Any) -> int:
        n = int(self._f.write(data))
        self._written += n
        self._writes += 1
        if self._written >= self._max_bytes or self._writes >= self._max_writes:
            self._f.flush()
            os.fsync(self._f.fileno())  # what was written is on disk when we die
            stop_here(f"after writing {self._written} bytes in {self._writes} writes")
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> StoppingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def patch_point(point: str, module: Any, *, max_bytes: int, max_writes: int) -> None:
    """Make the writer in ``module`` (schema.codec or runtime.checkpoint) stop at ``point``.

    Patch right before the write: the os functions are the process's own, and loading a
    bundle uses them too (the compile cache writes atomically).
    """
    if point == "replace":
        os.replace = lambda *a, **k: stop_here("before os.replace")
    elif point == "fsync":
        os.fsync = lambda *a, **k: stop_here("before os.fsync")
    elif point == "data" and hasattr(module, "write_bundle"):
        real_open = open
        module.open = lambda *a, **k: StoppingFile(real_open(*a, **k), max_bytes, max_writes)
    elif point == "data":
        real_fdopen = os.fdopen
        os.fdopen = lambda *a, **k: StoppingFile(real_fdopen(*a, **k), max_bytes, max_writes)
    else:
        raise SystemExit(f"unknown point {point!r}")


def write_new_bundle(target: Path, point: str) -> None:
    """Overwrite ``target`` with another bundle: linear_adamw with a new producer string
    (so another digest) and, for the data point, a 48 MB extra section."""
    from runtime_helpers import golden_bundle

    from stepbundle.schema import SectionKind, SectionPayload, open_bundle, write_bundle
    from stepbundle.schema import atomic as codec

    with open_bundle(golden_bundle("linear_adamw")) as b:
        manifest = b.manifest
        payloads = [
            SectionPayload(s.name, s.kind, bytes(b.section(s.name))) for s in manifest.sections
        ]
    manifest = dataclasses.replace(
        manifest, producer=dataclasses.replace(manifest.producer, stepbundle="0.1.0+rewritten")
    )
    if point == "data":
        ballast = (bytes(range(256)) * (BALLAST_BYTES // 256))[:BALLAST_BYTES]
        payloads.append(SectionPayload("ballast", SectionKind.TENSOR, ballast))
    patch_point(point, codec, max_bytes=DATA_SIGNAL_AFTER, max_writes=10**9)
    write_bundle(target, manifest, payloads)


def write_new_checkpoint(target: Path, point: str, cache: str) -> None:
    """Train linear_adamw three steps and save its checkpoint over ``target``."""
    from runtime_helpers import golden_batches, golden_bundle

    from stepbundle.runtime import load
    from stepbundle.runtime.state import checkpoint

    trainer = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(compile=CompileOptions(cache_dir=cache or False)),
    )
    trainer.run(golden_batches("linear_adamw"), 3)
    # For the data point: the length, the JSON header, then the first tensor's bytes.
    patch_point(point, checkpoint, max_bytes=10**12, max_writes=3)
    trainer.save_checkpoint(target)


def main() -> None:
    mode, target = sys.argv[1], Path(sys.argv[2])
    cache = sys.argv[3] if len(sys.argv) > 3 else ""
    kind, point = mode.split("-")
    if kind == "bundle":
        write_new_bundle(target, point)
    else:
        write_new_checkpoint(target, point, cache)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
