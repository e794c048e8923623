"""Compile one program of a bundle: check it against its tables, set donation, compile.

The module's own aliasing attributes are never trusted: they are stripped and
regenerated from the manifest's output table (``StateUpdateOutput.donates``). The
signature of ``@main`` must agree with the binding tables row by row, and every
custom call must be on the allowlist.

Imports: numpy, jaxlib (through _compat and mlir), stepbundle.schema.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepbundle.schema.errors import SchemaValidationError
from stepbundle.schema.manifest import Program, StateUpdateOutput
from stepbundle.stablehlo import artifact as mlir

from . import _compat, packing
from .errors import PlatformError
from .sharding import AXIS, MESH, Placement

__all__ = ["CompiledProgram", "compile_program", "default_cache_dir"]


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
    cache_hit: bool
    compile_seconds: float


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
    cache_dir: Path | None,
    layout: packing.Layout | None = None,
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
      cache_dir: persistent compile cache folder, or None to always compile.
      layout: how the trainer holds the state; with packs, the program is compiled
        behind a wrapper that takes and returns them, and the returned
        ``CompiledProgram.program`` describes the wrapper's arguments and results.
    """
    import time

    platform = str(client.platform)
    if program.platforms and platform not in program.platforms:
        raise PlatformError(
            f"{where} needs platform {' or '.join(program.platforms)}, but the runtime was "
            f"asked to run it on {platform}. Run it with --device "
            f"{program.platforms[0]} on a machine that has one, or re-export for {platform}."
        )
    t0 = time.perf_counter()
    try:
        module = mlir.parse_artifact(artifact)
    except Exception as e:
        raise SchemaValidationError(
            f"{where}.section",
            f"the program could not be parsed as StableHLO ({e}). Re-export the bundle.",
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
    if layout is not None and layout.packs:
        module, program = packing.wrap_program(module, program, layout)
    devices = list(placement.devices)
    n = len(devices)
    if placement.partitioned:
        module.set_mesh(MESH, [(AXIS, n)])
        arg_shardings, result_shardings = placement.annotations(program)
        module.set_arg_attributes(_aliases(program, donate), arg_shardings)
        module.set_result_shardings(result_shardings)
    else:
        module.set_arg_attributes(_aliases(program, donate))
    bytecode = module.bytecode()
    options = _compat.compile_options(n, [d.id for d in devices])
    key = hashlib.sha256()
    for part in (
        b"stepbundle-cache-v3",
        _compat.JAXLIB_VERSION.encode(),
        platform.encode(),
        str(getattr(client, "platform_version", "")).encode(),
        str(devices[0].device_kind).encode(),
        # A serialized executable stays bound to the devices it was compiled for: one
        # compiled for cuda:0 and loaded for cuda:1 fails at its first step.
        ",".join(f"{d.id}@{d.process_index}" for d in devices).encode(),
        bytecode,
    ):
        key.update(len(part).to_bytes(8, "little"))
        key.update(part)
    cache_file = cache_dir / f"{key.hexdigest()}.xla" if cache_dir is not None else None
    if cache_file is not None and cache_file.is_file():
        try:
            exe = _compat.deserialize_executable(client, cache_file.read_bytes(), devices, options)
            return CompiledProgram(program, exe, donate, True, time.perf_counter() - t0)
        except Exception:
            # A damaged or foreign cache entry is only a cache miss.
            pass
    exe = _compat.compile_program(client, bytecode, devices, options)
    if cache_file is not None:
        # A read-only or full cache folder must not fail a run.
        with contextlib.suppress(Exception):
            _write_atomic(cache_file, _compat.serialize_executable(client, exe))
    return CompiledProgram(program, exe, donate, False, time.perf_counter() - t0)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
