"""Compile one program of a bundle: check it, rewrite it, compile it through the cache.

Three separate steps, each in its own module: ``validate.check_program`` (the platform,
the custom-call allowlist, host transfers, the signature against the binding tables),
``rewrites.apply_rewrites`` (the named pipeline: the module's own aliasing attributes
are stripped and regenerated from the manifest's output table, precision, packing, the
K-step loop, shardings) and ``CompileCache.compile`` (a verified entry or a compile).

Imports: jaxlib (through _compat), stepbundle.schema, stepbundle.stablehlo.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stepbundle.schema.manifest import Program
from stepbundle.stablehlo.attention import StateValues

from .. import _compat
from ..placement import packing
from ..placement.sharding import Placement
from .compile_cache import CacheEvent, CacheOutcome, CompileCache
from .cpu_numerics import cpu_numerics
from .rewrites import RewriteContext, Stage, apply_rewrites
from .validate import check_program

__all__ = ["CompiledProgram", "compile_program"]


@dataclass
class CompiledProgram:
    """A loaded executable and the facts the trainer needs to feed it."""

    program: Program
    executable: Any
    donating: bool
    cache: CacheEvent
    fused_attention: int = 0
    attention_kept: tuple[str, ...] = ()
    pinned_state: tuple[str, ...] = ()

    @property
    def cache_hit(self) -> bool:
        return self.cache.outcome is CacheOutcome.HIT


def compile_program(
    client: Any,
    placement: Placement,
    artifact: bytes | memoryview,
    program: Program,
    *,
    where: str,
    label: str,
    donate: bool,
    cache: CompileCache,
    layout: packing.Layout | None = None,
    steps_per_call: int = 1,
    matmul_precision: str | None = None,
    fused_attention: bool = True,
    scalar_constants: Mapping[int, float] | None = None,
    state_values: StateValues | None = None,
) -> CompiledProgram:
    """Check, rewrite and compile ``program`` for ``placement``'s devices.

    Args:
      client: the PJRT client.
      placement: the devices it runs on (one, or a mesh of several for SPMD data
        parallelism) and how each argument and result is sharded over them.
      artifact: the program section's bytes (digest already checked).
      program: its manifest record.
      where: field path of the program, for error messages.
      label: its name in the cache's events and ``load_info`` (``"train[0]"``).
      donate: whether state inputs are donated to their updates.
      cache: the compile cache (``CompileCache(None)`` compiles every time).
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
      fused_attention: let a TPU run traced attention as fused kernels
        (``rewrites.fused_attention``).
      scalar_constants: the program's scalar constant arguments (number -> value).
      state_values: the state arguments it never writes, as loaded
        (``state_masks.unwritten_state``); ``CompiledProgram.pinned_state`` names those
        the compiled program assumes.
    """
    platform = str(client.platform)
    module = check_program(artifact, program, where, platform)
    # As accurate as PyTorch's CPU kernels: long sums in blocks, YNNPACK's fusions off.
    numerics = cpu_numerics() if platform == "cpu" else None
    ctx = RewriteContext(
        platform=platform,
        placement=placement,
        layout=layout,
        donate=donate,
        steps_per_call=steps_per_call,
        matmul_precision=matmul_precision,
        fused_attention=fused_attention,
        scalar_constants=dict(scalar_constants or {}),
        state_values=dict(state_values or {}),
        blocked_sums=numerics is not None and numerics.blocked_sums,
    )
    stage = apply_rewrites(Stage(module, program), ctx)
    devices = list(placement.devices)
    overrides = numerics.overrides if numerics is not None else ()
    options = _compat.compile_options(len(devices), [d.id for d in devices], overrides)
    exe, event = cache.compile(label, client, stage.module.bytecode(), devices, options)
    return CompiledProgram(
        stage.program,
        exe,
        donate,
        event,
        ctx.notes.get("fused_attention", 0),
        tuple(ctx.kept_attention),
        tuple(dict.fromkeys(ctx.pinned_state)),
    )
