"""Compile one program of a bundle: check it, rewrite it, compile it through the cache.

Three separate steps, each in its own module: ``validate.check_program`` (the platform,
the custom-call allowlist, host transfers, the signature against the binding tables),
``rewrites.apply_rewrites`` (the named pipeline: the module's own aliasing attributes
are stripped and regenerated from the manifest's output table, precision, packing, the
K-step loop, shardings) and ``CompileCache.compile`` (a verified entry or a compile).

Imports: jaxlib (through _compat), stepbundle.schema, stepbundle.stablehlo.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stepbundle.schema.manifest import Program
from stepbundle.stablehlo.attention import StateValues
from stepbundle.stablehlo.head_barriers import (
    MIN_VOCABULARY,
    count_head_barriers,
    head_vocabularies,
)

from .. import _compat
from ..fallback import warn_once
from ..placement import packing
from ..placement.sharding import Placement
from . import head_choice
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
    head_barriers: bool = False
    head_choice: str = ""  # what was compared and kept, in words ("" where nothing was)
    bf16_products: int = 0  # products compiled bf16-out (rewrites.bf16_products)
    bf16_weight_gradients: int = 0  # of them, weight gradients in torch_xla's operand order
    regathered_products: int = (
        0  # products reading a re-gathered weight (rewrites.regather_weights)
    )

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
    head_barriers: bool | None = None,
    bf16_products: bool = True,
    regather_weights: bool = True,
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
      head_barriers: True puts optimization barriers around the output head's products,
        False does not; None (a TPU only) compiles without, and where the compiled program
        fuses a residual stream into a head product (``head_choice.fused_stream``)
        compiles with them too and keeps the program libtpu estimates faster
        (``CompiledProgram.head_choice`` says what was compared).
      bf16_products: on a TPU, compile bf16 products rounded at once bf16-out
        (``rewrites.bf16_products``); ``CompiledProgram.bf16_products`` counts them.
      regather_weights: under fsdp and fsdp+tp, re-gather split weights for their later
        products (``rewrites.regather_weights``); ``CompiledProgram.regathered_products``
        counts them.
    """
    platform = str(client.platform)
    # As accurate as PyTorch's CPU kernels: long sums in blocks, YNNPACK's fusions off.
    numerics = cpu_numerics() if platform == "cpu" else None
    devices = list(placement.devices)
    overrides = numerics.overrides if numerics is not None else ()
    options = _compat.compile_options(len(devices), [d.id for d in devices], overrides)

    def build(barriers: bool, tag: str = "") -> tuple[Any, CacheEvent, RewriteContext, Stage]:
        module = check_program(artifact, program, where, platform)
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
            head_barriers=barriers,
            bf16_products=bf16_products,
            regather_weights=regather_weights,
        )
        stage = apply_rewrites(Stage(module, program), ctx)
        exe, event = cache.compile(label + tag, client, stage.module.bytecode(), devices, options)
        return exe, event, ctx, stage

    def heads() -> frozenset[int]:  # the vocabularies of a program with a head to hold
        module = check_program(artifact, program, where, platform)
        return head_vocabularies(module) if count_head_barriers(module) else frozenset()

    built = build(bool(head_barriers))
    choice = ""
    if head_barriers is None and platform == "tpu":
        built, choice = _choose_head_barriers(built, build, heads, label)
    elif head_barriers:
        n = built[2].notes.get("head_barriers", 0)
        choice = (
            f"{label}: optimization barriers around {n} product{'s' if n != 1 else ''} of the "
            "output head (as asked)"
            if n
            else f"{label}: no output head to hold (no product with a dimension of a "
            f"vocabulary: at least {MIN_VOCABULARY:,}, along which an embedding is looked up)"
        )
    exe, event, ctx, stage = built
    return CompiledProgram(
        stage.program,
        exe,
        donate,
        event,
        ctx.notes.get("fused_attention", 0),
        tuple(ctx.kept_attention),
        tuple(dict.fromkeys(ctx.pinned_state)),
        head_barriers=bool(ctx.notes.get("head_barriers")),
        head_choice=choice,
        bf16_products=ctx.notes.get("bf16_products", 0),
        bf16_weight_gradients=ctx.notes.get("bf16_weight_gradients", 0),
        regathered_products=ctx.notes.get("regathered_products", 0),
    )


def _choose_head_barriers(
    built: tuple[Any, CacheEvent, RewriteContext, Stage],
    build: Callable[[bool, str], tuple[Any, CacheEvent, RewriteContext, Stage]],
    heads: Callable[[], frozenset[int]],
    label: str,
) -> tuple[tuple[Any, CacheEvent, RewriteContext, Stage], str]:
    """``built`` (compiled without barriers), or the program compiled with them where
    ``built`` fuses a residual stream into a head product (a fusion that reads or writes a
    vocabulary-sized tensor: ``heads`` gives the program's vocabularies) and libtpu's cost
    model prices the barriered program lower; and what was compared, in words ("" where
    nothing). The barriered program is compiled under its own label
    (``LABEL+head-barriers`` in the cache's events). Where counting the head or compiling
    the barriered program fails (memory, or anything else), the program is kept as it was,
    the words say why and a ``StepbundleFallbackWarning`` says so once."""
    text = _optimized_text(built[0])
    if head_choice.fused_stream(text) is None:  # nothing to weigh (most programs)
        return built, ""
    before = head_choice.estimated_cycles(text)
    if before is None:
        return built, ""
    try:
        found = head_choice.fused_stream(text, vocabularies=heads())
        if found is None:  # a fusion of many results, not the head's
            return built, ""
        seen = f"{label}: XLA fused the residual stream into the output head ({found.describe()})"
        other = build(True, "+head-barriers")
    except Exception as e:  # the program as it was compiled is a good one: keep it
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        warn_once(
            "head-barriers",
            f"stepbundle kept {label} without optimization barriers around the output head: "
            f"weighing them failed ({why})",
        )
        return built, (
            f"{label}: the program with optimization barriers around the output head's "
            f"products could not be weighed ({why}): compiled without them"
        )
    after = head_choice.estimated_cycles(_optimized_text(other[0]))
    if after is None or not other[2].notes.get("head_barriers"):
        return built, f"{seen}; no estimate of the program with barriers: compiled without them"
    kept = after < before
    return (other if kept else built), (
        f"{seen}; libtpu's cost model prices the program with optimization barriers around "
        f"the head's products at {after / before:.2f}x the one without ({after / 1e6:.1f}M "
        f"against {before / 1e6:.1f}M cycles): "
        + ("compiled with them" if kept else "compiled without them")
    )


def _optimized_text(executable: Any) -> str:
    """The compiled program's optimized HLO as text ("" where the executable has none)."""
    try:
        return "\n".join(m.to_string() for m in executable.hlo_modules())
    except Exception:  # a jaxlib or plugin without it: nothing to read
        return ""
