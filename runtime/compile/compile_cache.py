"""The persistent compile cache: compiled executables kept by everything they depend on.

``CompileCache`` is one folder (or a URL) of entries. ``key`` names what an executable
depends on (the rewritten bytecode, jaxlib, the platform and its version, the devices,
the XLA flags); ``read`` hands back an entry's payload only when its header says it is
intact and is this key's; ``write`` replaces an entry atomically. ``compile`` puts them
together (a verified hit, or a compile and a write) and records a ``CacheEvent`` per
program in ``events``; ``warn`` turns the events that lost a hit into one
``CacheWarning`` each per process. A cache with no folder compiles every time and
records ``OFF``.

Imports: jaxlib (through _compat), stepbundle.schema (atomic writes), fsspec (through
remote, for URLs).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepbundle.schema.atomic import atomic_write

from .. import _compat
from ..fallback import StepbundleFallbackWarning, warn_once
from ..io import remote

__all__ = [
    "CACHE_KEY_VERSION",
    "CacheEvent",
    "CacheOutcome",
    "CacheWarning",
    "CompileCache",
    "cache_key",
    "read_cache_entry",
    "write_cache_entry",
]

# The compile cache's key and entry layout. Bump it whenever what an executable depends
# on, or how an entry is stored, changes, so that old entries become misses. (A rewrite
# in rewrites.py changes the bytecode, which is keyed: it needs no bump.)
# v1 (2026-11-30): bytecode, jaxlib version, platform, platform version, device kind.
# v2 (2026-11-30): data parallelism: the partition count is part of the compile options.
# v3 (2026-11-30): device ids and process indices (an executable is bound to its devices).
# v4 (2026-12-01): an entry is a header (magic, its own key, the payload's SHA-256) and
#   the payload; both are checked before the payload is deserialized.
# v5 (2026-12-01): the XLA_FLAGS and LIBTPU_INIT_ARGS environment variables, as jax's own
#   cache keys them: an executable compiled under other XLA flags is another executable.
# v6 (2026-12-06): the compile options' XLA option overrides (on the CPU, YNNPACK's
#   fusions off: _compat.cpu_numerics_overrides); a v5 entry compiled with them on would
#   otherwise be reused.
# v7 (2026-12-06): CPU programs' long float sums in blocks (rewrites.blocked_sums,
#   cpu_numerics.py). The rewritten bytecode is keyed already, so a v6 entry could not be
#   served for it; the version moves with the CPU numerics so that the key says which
#   decision an entry was compiled under, and v6 entries are retired in one step.
CACHE_KEY_VERSION = b"stepbundle-cache-v7"
_ENTRY_MAGIC = b"SBXC\x00\x04\r\n"
_ENTRY_HEADER = len(_ENTRY_MAGIC) + 32 + 32
_NO_ENTRY = "no entry"


class CacheWarning(StepbundleFallbackWarning):
    """The compile cache could not be read or written; the run goes on without it."""


class CacheOutcome(enum.Enum):
    OFF = "off"  # no cache folder
    HIT = "hit"
    MISS = "miss"  # compiled; the reason says why the cache had nothing usable


@dataclass(frozen=True)
class CacheEvent:
    """What the compile cache did for one program, and why."""

    outcome: CacheOutcome
    reason: str
    path: Path | str | None = None  # a str for an entry at a URL
    write_error: str | None = None  # the entry could not be written (the run goes on)


def cache_key(client: Any, devices: Sequence[Any], bytecode: bytes, options: Any = None) -> bytes:
    """The SHA-256 key of an executable: everything it depends on, each part length-prefixed."""
    overrides = _compat.option_overrides(options) if options is not None else ()
    key = hashlib.sha256()
    for part in (
        CACHE_KEY_VERSION,
        _compat.JAXLIB_VERSION.encode(),
        str(client.platform).encode(),
        str(getattr(client, "platform_version", "")).encode(),
        str(devices[0].device_kind).encode(),
        # A serialized executable stays bound to the devices it was compiled for: one
        # compiled for cuda:0 and loaded for cuda:1 fails at its first step.
        ",".join(f"{d.id}@{d.process_index}" for d in devices).encode(),
        _xla_flags(),
        "\n".join(f"{k}={v}" for k, v in overrides).encode(),
        bytecode,
    ):
        key.update(len(part).to_bytes(8, "little"))
        key.update(part)
    return key.digest()


class CompileCache:
    """A compile cache folder (a path, or a URL whose entries only ``writer`` writes),
    or none, and what it did for each program of a load.

    Attributes:
      folder: the entries' folder, or None for no cache.
      writer: whether this process writes entries at a URL (one writer per job, not one
        per host); local folders are always written.
      events: per program label (``"train[0]"``), what the cache did, in compile order.
    """

    def __init__(self, folder: Path | str | None, *, writer: bool = True) -> None:
        self.folder = folder
        self.writer = writer
        self.events: dict[str, CacheEvent] = {}

    @property
    def hits(self) -> int:
        return sum(e.outcome is CacheOutcome.HIT for e in self.events.values())

    @property
    def compiled(self) -> int:
        return sum(e.outcome is not CacheOutcome.HIT for e in self.events.values())

    def entry(self, key: bytes) -> Path | str:
        """Where the entry for ``key`` lives (the folder must be set)."""
        assert self.folder is not None
        name = f"{key.hex()}.xla"
        return (
            self.folder / name if isinstance(self.folder, Path) else remote.join(self.folder, name)
        )

    def read(self, key: bytes) -> tuple[bytes | None, str]:
        """The payload of ``key``'s entry if it is intact (``read_cache_entry``)."""
        return read_cache_entry(self.entry(key), key)

    def write(self, key: bytes, payload: bytes) -> None:
        """Write ``key``'s entry atomically (``write_cache_entry``)."""
        write_cache_entry(self.entry(key), key, payload)

    def compile(
        self, label: str, client: Any, bytecode: bytes, devices: Sequence[Any], options: Any
    ) -> tuple[Any, CacheEvent]:
        """The loaded executable of ``bytecode`` (a verified entry, or compiled and
        written), and what the cache did, also recorded as ``events[label]``."""
        exe, event = self._compile(client, bytecode, devices, options)
        self.events[label] = event
        return exe, event

    def _compile(
        self, client: Any, bytecode: bytes, devices: Sequence[Any], options: Any
    ) -> tuple[Any, CacheEvent]:
        if self.folder is None:
            exe = _compat.compile_bytecode(client, bytecode, devices, options)
            return exe, CacheEvent(CacheOutcome.OFF, "cache off")
        key = cache_key(client, devices, bytecode, options)
        path = self.entry(key)
        payload, why = self.read(key)
        if payload is not None:
            try:
                exe = _compat.deserialize_executable(client, payload, devices, options)
                return exe, CacheEvent(CacheOutcome.HIT, "verified entry", path)
            except _compat.JaxRuntimeError as e:
                # The entry is intact and ours, but this jaxlib would not load it.
                why = f"the entry would not deserialize ({e})"
        exe = _compat.compile_bytecode(client, bytecode, devices, options)
        if isinstance(path, str) and not self.writer:
            # A shared cache at a URL gets one writer per job, not one per host.
            return exe, CacheEvent(CacheOutcome.MISS, why, path)
        write_error = None
        try:
            self.write(key, _compat.serialize_executable(client, exe))
        except (OSError, _compat.JaxRuntimeError) as e:
            # A read-only or full cache folder, or a PJRT plugin that cannot serialize
            # executables (UNIMPLEMENTED), must not fail a run; ``warn`` says so once.
            write_error = f"{type(e).__name__}: {e}"
        return exe, CacheEvent(CacheOutcome.MISS, why, path, write_error)

    def warn(self, stacklevel: int) -> None:
        """Warn (once per process each) that an entry was not used, or not written.

        ``stacklevel`` is ``warnings.warn``'s, counted from the caller of this method
        (1: that caller).
        """
        level = stacklevel + 2  # warn_once's warnings.warn, then this method
        for event in self.events.values():
            if event.outcome is CacheOutcome.MISS and event.reason != _NO_ENTRY:
                warn_once(
                    "cache-read",
                    f"a compile-cache entry in {self.folder} was not used: {event.reason}. The "
                    "program is compiled again and the entry replaced; load_info.cache lists "
                    "every program's outcome.",
                    CacheWarning,
                    stacklevel=level,
                )
            if event.write_error is not None:
                warn_once(
                    "cache-write",
                    f"cannot write the compile cache in {self.folder} ({event.write_error}); "
                    "every load will compile again until it is writable.",
                    CacheWarning,
                    stacklevel=level,
                )


def read_cache_entry(path: Path | str, key: bytes) -> tuple[bytes | None, str]:
    """The payload of a cache entry if it is intact and is the entry for ``key``.

    Returns ``(None, reason)`` otherwise: no entry, unreadable, not an entry, written for
    another key (a renamed or copied file), or a payload whose digest does not match. The
    payload is never handed to XLA unless all of this holds: a damaged executable can
    crash the process or compute wrong numbers.

    The key and digest catch damage and mix-ups; they are not a signature. An entry
    forged on purpose (this key, another executable, that executable's digest) passes
    and runs, as would a forged bundle: the cache folder must be as trusted as the
    bundles and the Python environment (scripts/fuzz.py --target cache shows what a
    forged entry does).
    """
    try:
        data = path.read_bytes() if isinstance(path, Path) else remote.read_object(path)
    except FileNotFoundError:
        return None, _NO_ENTRY
    except OSError as e:
        return None, f"the entry is unreadable ({type(e).__name__}: {e})"
    if len(data) < _ENTRY_HEADER or not data.startswith(_ENTRY_MAGIC):
        return None, "the file is not a compile-cache entry of this version"
    stored_key = data[len(_ENTRY_MAGIC) : len(_ENTRY_MAGIC) + 32]
    digest = data[len(_ENTRY_MAGIC) + 32 : _ENTRY_HEADER]
    payload = data[_ENTRY_HEADER:]
    if not hmac.compare_digest(stored_key, key):
        return None, "the entry belongs to another program or device set"
    if not hmac.compare_digest(hashlib.sha256(payload).digest(), digest):
        return None, "the entry is damaged (its digest does not match)"
    return payload, "verified entry"


def write_cache_entry(path: Path | str, key: bytes, payload: bytes) -> None:
    """Write a cache entry atomically: header (magic, key, payload digest), then payload.

    At a URL, the entry is uploaded under a temporary name and moved into place
    (``remote.write_object``): no reader sees part of an entry.
    """
    chunks = [_ENTRY_MAGIC, key, hashlib.sha256(payload).digest(), payload]
    if isinstance(path, str):
        remote.write_object(path, chunks)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, chunks)


def _xla_flags() -> bytes:
    """The XLA flags of this process's environment, as they go into the cache key.

    Every flag is kept, in order (a repeated flag's last value wins, so order matters);
    unlike jax, none is left out as output-only: a needless miss costs a compile, a
    wrong hit costs wrong numbers. XLA parses these once per process, so changing
    ``os.environ`` after the first compile changes the key but not the executable;
    set them before the process starts.
    """
    parts = [
        f"{name}={' '.join(os.environ.get(name, '').split())}"
        for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
    ]
    return "\n".join(parts).encode()
