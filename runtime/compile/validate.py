"""What a program section must be before anything rewrites or compiles it.

``check_program`` parses the section and refuses it unless it runs on this platform,
calls only allowlisted custom-call targets, exchanges no data with the host outside its
arguments and results, and has a ``@main`` whose signature matches the manifest's
binding and output tables row by row. It only reads the module; ``rewrites.py`` changes
it, ``program.py`` compiles it.

Imports: stepbundle.schema, stepbundle.stablehlo.
"""

from __future__ import annotations

from stepbundle.schema.errors import SchemaValidationError
from stepbundle.schema.manifest import Program
from stepbundle.stablehlo import artifact as mlir

from ..errors import PlatformError

__all__ = ["check_program", "check_signature"]


def check_program(
    artifact: bytes | memoryview, program: Program, where: str, platform: str
) -> mlir.Module:
    """The parsed module of ``artifact``, once every check passed.

    Args:
      artifact: the program section's bytes (digest already checked).
      program: its manifest record.
      where: field path of the program, for error messages.
      platform: the platform it is about to be compiled for.

    Raises:
      PlatformError: the program lists the platforms it needs, and this is not one.
      SchemaValidationError: not a StableHLO artifact, a custom call off the allowlist,
        a host transfer, or a signature the tables do not describe.
    """
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
    check_signature(module, program, where)
    return module


def check_signature(module: mlir.Module, program: Program, where: str) -> None:
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
