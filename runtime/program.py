"""Compile one program of a bundle: check it against its tables, set donation, compile.

The module's own aliasing attributes are never trusted: they are stripped and
regenerated from the manifest's output table (``StateUpdateOutput.donates``). The
signature of ``@main`` must agree with the binding tables row by row, and every
custom call must be on the allowlist.

Imports: numpy, jaxlib (through _compat and mlir), stepbundle.schema.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepbundle.schema.atomic import atomic_write
from stepbundle.schema.errors import SchemaValidationError
from stepbundle.schema.manifest import Program, StateUpdateOutput
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.conv_layout import canonicalize_convolutions
from stepbundle.stablehlo.precision import set_matmul_precision

from . import _compat, multistep, packing, remote
from .errors import PlatformError
from .fallback import StepbundleFallbackWarning, warn_once
from .sharding import AXIS, MESH, Placement

__all__ = [
    "CACHE_KEY_VERSION",
    "CacheEvent",
    "CacheOutcome",
    "CacheWarning",
    "CompiledProgram",
    "compile_program",
    "default_cache_dir",
]

# The compile cache's key and entry layout. Bump it whenever what an executable depends
# on, or how an entry is stored, changes, so that old entries become misses.
# v1 (2026-11-30): bytecode, jaxlib version, platform, platform version, device kind.
# v2 (2026-11-30): data parallelism: the partition count is part of the compile options.
# v3 (2026-11-30): device ids and process indices (an executable is bound to its devices).
# v4 (2026-12-01): an entry is a header (magic, its own key, the payload's SHA-256) and
#   the payload; both are checked before the payload is deserialized.
# v5 (2026-12-01): the XLA_FLAGS and LIBTPU_INIT_ARGS environment variables, as jax's own
#   cache keys them: an executable compiled under other XLA flags is another executable.
CACHE_KEY_VERSION = b"stepbundle-cache-v5"
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


def default_cache_dir() -> Path:
    """``$STEPBUNDLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/stepbundle``, else ~/.cache/stepbundle."""
    env = os.environ.get("STEPBUNDLE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stepbundle"


@dataclass
class CompiledProgram:
    """A loaded executable and the facts the trainer needs to feed it."""

    program: Program
    executable: Any
    donating: bool
    cache: CacheEvent

    @property
    def cache_hit(self) -> bool:
        return self.cache.outcome is CacheOutcome.HIT


def _check_signature(module: mlir.Module, program: Program, where: str) -> None:
    """Every row of the binding and output tables matches @main's signature."""
    sig = module.signature()
    sides = (
        ("inputs", "binding table", "argument", sig.inputs, program.inputs),
        ("outputs", "output table", "result", sig.results, program.outputs),
    )
    for field, table, what, types, rows in sides:
        if len(types) != len(rows):
            raise SchemaValidationError(
                f"{where}.{field}",
                f"the program's @main has {len(types)} {what}s but the {table} has "
                f"{len(rows)} rows. The bundle is inconsistent; re-export it.",
            )
        for i, ((dt, shape), row) in enumerate(zip(types, rows)):
            if dt != row.spec.dtype.value or shape != row.spec.shape:
                raise SchemaValidationError(
                    f"{where}.{field}[{i}]",
                    f"the {table} says {row.spec} but @main's {what} {i} is "
                    f"{dt}[{','.join(map(str, shape))}]. Re-export the bundle.",
                )


def _aliases(program: Program, donate: bool) -> list[int | None]:
    aliases: list[int | None] = [None] * len(program.inputs)
    if donate:
        for j, out in enumerate(program.outputs):
            if isinstance(out, StateUpdateOutput) and out.donates is not None:
                aliases[out.donates] = j
    return aliases


def compile_program(
    client: Any,
    placement: Placement,
    artifact: bytes | memoryview,
    program: Program,
    *,
    where: str,
    donate: bool,
    cache_dir: Path | str | None,
    layout: packing.Layout | None = None,
    steps_per_call: int = 1,
    matmul_precision: str | None = None,
) -> CompiledProgram:
    """Check, re-attribute and compile ``program`` for ``devices``.

    Args:
      client: the PJRT client.
      placement: the devices it runs on (one, or a mesh of several for SPMD data
        parallelism) and how each argument and result is sharded over them.
      artifact: the program section's bytes (digest already checked).
      program: its manifest record.
      where: field path of the program, for error messages.
      donate: whether state inputs are donated to their updates.
      cache_dir: persistent compile cache folder (a path, or a URL whose entries are
        written by the job's process 0 only), or None to always compile.
      layout: how the trainer holds the state; with packs, the program is compiled
        behind a wrapper that takes and returns them, and the returned
        ``CompiledProgram.program`` describes the wrapper's arguments and results.
      steps_per_call: with K > 1, the program is compiled behind a loop of K steps
        over stacked batches (``multistep.py``); ``CompiledProgram.program`` then
        describes the loop's stacked arguments and results.
      matmul_precision: "default", "high" or "highest" sets ``precision_config`` on
        every dot_general and convolution (``stablehlo/precision.py``) before compiling;
        the setting is in the bytecode, so it is in the cache key. None leaves the
        program's own.
    """
    platform = str(client.platform)
    if program.platforms and platform not in program.platforms:
        raise PlatformError(
            f"{where} needs platform {' or '.join(program.platforms)}, but the runtime was "
            f"asked to run it on {platform}. Run it with --device "
            f"{program.platforms[0]} on a machine that has one, or re-export for {platform}."
        )
    try:
        module = mlir.parse_artifact(artifact)
    except mlir.ArtifactError as e:
        raise SchemaValidationError(
            f"{where}.section",
            f"{e}. A program section must be a StableHLO portable artifact (FORMAT.md); "
            "re-export the bundle with this version of stepbundle's exporter.",
        ) from None
    bad = module.custom_call_targets() - mlir.ALLOWED_CUSTOM_CALLS
    if bad:
        raise SchemaValidationError(
            f"{where}.section",
            f"the program calls custom call target(s) {sorted(bad)}, which are not on the "
            "runtime's allowlist. A bundle is code: only bundles from trusted producers "
            "should be run, and the runtime refuses native calls the exporter never emits.",
        )
    io = module.host_transfer_ops()
    if io:
        raise SchemaValidationError(
            f"{where}.section",
            f"the program uses {sorted(io)}, which exchange data with the host outside the "
            "step's inputs and outputs. The exporter never writes them; refusing the bundle.",
        )
    _check_signature(module, program, where)
    module.strip_attributes()
    if matmul_precision is not None:
        set_matmul_precision(module, matmul_precision)
    if layout is not None and layout.packs:
        module, program = packing.wrap_program(module, program, layout)
    if steps_per_call > 1:
        # XLA:CPU puts only the entry computation's convolutions in the order of its
        # fast kernels; inside the loop they would run (and round) otherwise.
        canonicalize_convolutions(module)
        module, program = multistep.wrap_steps(module, program, steps_per_call)
    devices = list(placement.devices)
    n = len(devices)
    if placement.partitioned:
        module.set_mesh(MESH, [(AXIS, n)])
        arg_shardings, result_shardings = placement.annotations(program, stacked=steps_per_call > 1)
        module.set_arg_attributes(_aliases(program, donate), arg_shardings)
        module.set_result_shardings(result_shardings)
    else:
        module.set_arg_attributes(_aliases(program, donate))
    bytecode = module.bytecode()
    options = _compat.compile_options(n, [d.id for d in devices])
    key = hashlib.sha256()
    for part in (
        CACHE_KEY_VERSION,
        _compat.JAXLIB_VERSION.encode(),
        platform.encode(),
        str(getattr(client, "platform_version", "")).encode(),
        str(devices[0].device_kind).encode(),
        # A serialized executable stays bound to the devices it was compiled for: one
        # compiled for cuda:0 and loaded for cuda:1 fails at its first step.
        ",".join(f"{d.id}@{d.process_index}" for d in devices).encode(),
        _xla_flags(),
        bytecode,
    ):
        key.update(len(part).to_bytes(8, "little"))
        key.update(part)
    if cache_dir is None:
        exe = _compat.compile_program(client, bytecode, devices, options)
        return CompiledProgram(program, exe, donate, CacheEvent(CacheOutcome.OFF, "cache off"))
    cache_file: Path | str = (
        cache_dir / f"{key.hexdigest()}.xla"
        if isinstance(cache_dir, Path)
        else remote.join(cache_dir, f"{key.hexdigest()}.xla")
    )
    payload, why = read_cache_entry(cache_file, key.digest())
    if payload is not None:
        try:
            exe = _compat.deserialize_executable(client, payload, devices, options)
            return CompiledProgram(
                program, exe, donate, CacheEvent(CacheOutcome.HIT, "verified entry", cache_file)
            )
        except _compat.JaxRuntimeError as e:
            # The entry is intact and ours, but this jaxlib would not load it.
            why = f"the entry would not deserialize ({e})"
    if why != _NO_ENTRY:
        warn_once(
            "cache-read",
            f"a compile-cache entry in {cache_dir} was not used: {why}. The program is "
            "compiled again and the entry replaced; load_info.cache lists every program's "
            "outcome.",
            CacheWarning,
            stacklevel=6,  # load()'s caller (through _Compiler.entry and _compile)
        )
    exe = _compat.compile_program(client, bytecode, devices, options)
    write_error = None
    if isinstance(cache_file, str) and not placement.writes_files:
        # A shared cache at a URL gets one writer per job, not one per host.
        return CompiledProgram(program, exe, donate, CacheEvent(CacheOutcome.MISS, why, cache_file))
    try:
        write_cache_entry(cache_file, key.digest(), _compat.serialize_executable(client, exe))
    except (OSError, _compat.JaxRuntimeError) as e:
        # A read-only or full cache folder, or a PJRT plugin that cannot serialize
        # executables (UNIMPLEMENTED), must not fail a run; say so once.
        write_error = f"{type(e).__name__}: {e}"
        warn_once(
            "cache-write",
            f"cannot write the compile cache in {cache_dir} ({write_error}); "
            "every load will compile again until it is writable.",
            CacheWarning,
            stacklevel=6,  # load()'s caller (through _Compiler.entry and _compile)
        )
    return CompiledProgram(
        program, exe, donate, CacheEvent(CacheOutcome.MISS, why, cache_file, write_error)
    )


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
