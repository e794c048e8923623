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
from typing import Any, Literal

from stepbundle.schema.errors import DeviceError
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
from . import head_choice, regather_choice
from .compile_cache import CacheEvent, CacheOutcome, CompileCache
from .cpu_numerics import cpu_numerics
from .rewrites import RewriteContext, Stage, apply_rewrites
from .validate import check_program

__all__ = ["CompiledProgram", "compile_program"]

_Built = tuple[Any, CacheEvent, RewriteContext, Stage]  # an executable and how it was made


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
    regather_choice: str = ""  # under "auto": what was compared and kept, in words

    @property
    def regathered(self) -> bool:
        """Whether the program was compiled with the ``regather-weights`` rewrite."""
        return self.regathered_products > 0

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
    regather_weights: bool | Literal["auto"] = "auto",
    device_memory: int | None = None,
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
        counts them. True always, False never; "auto" compiles the program as written,
        and with the rewrite too only where the first does not fit
        (``regather_choice.py``; ``CompiledProgram.regather_choice`` says what was
        compared).
      device_memory: the bytes the program may use on a device, for "auto"; None: what
        the devices report (``regather_choice.device_memory``).
    """
    platform = str(client.platform)
    # As accurate as PyTorch's CPU kernels: long sums in blocks, YNNPACK's fusions off.
    numerics = cpu_numerics() if platform == "cpu" else None
    devices = list(placement.devices)
    overrides = numerics.overrides if numerics is not None else ()
    options = _compat.compile_options(len(devices), [d.id for d in devices], overrides)

    def rewrite(barriers: bool, regather: bool) -> tuple[RewriteContext, Stage]:
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
            regather_weights=regather,
        )
        return ctx, apply_rewrites(Stage(module, program), ctx)

    def compile_stage(ctx: RewriteContext, stage: Stage, tag: str = "") -> _Built:
        exe, event = cache.compile(label + tag, client, stage.module.bytecode(), devices, options)
        return exe, event, ctx, stage

    regather = regather_weights is True

    def build(barriers: bool, tag: str = "") -> _Built:
        return compile_stage(*rewrite(barriers, regather), tag)

    def heads() -> frozenset[int]:  # the vocabularies of a program with a head to hold
        module = check_program(artifact, program, where, platform)
        return head_vocabularies(module) if count_head_barriers(module) else frozenset()

    regathering = ""
    if regather_weights == "auto":

        def memory() -> int | None:  # asked only where the analysis is weighed
            if device_memory is not None:
                return device_memory
            return regather_choice.device_memory(devices)

        built, regathering = _choose_regather(
            rewrite, compile_stage, bool(head_barriers), label, memory
        )
        regather = bool(built[2].notes.get("regathered_products"))
    else:
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
        regather_choice=regathering,
    )


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _choose_regather(
    rewrite: Callable[[bool, bool], tuple[RewriteContext, Stage]],
    compile_stage: Callable[[RewriteContext, Stage, str], _Built],
    barriers: bool,
    label: str,
    memory: Callable[[], int | None],
) -> tuple[_Built, str]:
    """``regather_weights="auto"``: the program compiled as written, or with the
    ``regather-weights`` rewrite where the first does not fit, and what was compared, in
    words ("" where the rewrite has nothing to do: one device, ``dp``, ``zero1``, no
    parameter read by two products).

    The rewritten program is compiled (under ``LABEL+regather-weights`` in the cache's
    events) where the compiler refused the program as written for memory
    (``regather_choice.memory_refusal``; it is then kept, and its own failure raises: a
    DeviceError naming both refusals where it too was refused for memory), or
    where XLA's memory analysis of it exceeds ``memory()`` (then the rewritten program is
    kept unless it needs more; a failure of the rewritten compile keeps the program as
    written, with a warning). Where ``memory()`` is None (a CPU, a described TPU slice) only a refusal
    counts."""
    ctx, stage = rewrite(barriers, False)
    sites = ctx.notes.get("regather_sites", 0)
    if not sites:
        return compile_stage(ctx, stage, ""), ""
    could = _plural(sites, "product")
    try:
        plain = compile_stage(ctx, stage, "")
    except Exception as e:
        why = regather_choice.memory_refusal(e)
        if why is None:
            raise
        other_ctx, other_stage = rewrite(barriers, True)
        n = other_ctx.notes.get("regathered_products", 0)
        if not n:  # the rewrite did not apply (it warned): the same program, refused
            raise
        try:
            other = compile_stage(other_ctx, other_stage, "+regather-weights")
        except Exception as again:
            why_again = regather_choice.memory_refusal(again)
            if why_again is None:
                raise
            raise DeviceError(
                f"{label} does not fit the device's memory in either form: the compiler "
                f"refused the program as written ({why.rstrip('.')}) and with the weights "
                f"re-gathered for {_plural(n, 'product')} ({why_again.rstrip('.')}). Split it "
                "over more devices, "
                "add a model axis (--layout fsdp+tp), train a smaller batch bucket, or "
                "checkpoint activations when exporting (docs/parallel.md)"
            ) from again
        return other, (
            f"{label}: the compiler refused the program as written for memory ({why}); "
            f"compiled with the weights re-gathered for {_plural(n, 'product')}"
        )
    need = regather_choice.memory_need(plain[0])
    limit = memory()
    if need is None:
        return plain, (
            f"{label}: compiled as written ({could} could re-gather a weight; no memory "
            "analysis of it to weigh)"
        )
    if limit is None:
        return plain, (
            f"{label}: compiled as written: it needs {regather_choice.gib(need)} a device, "
            f"and the devices report no memory to weigh that against ({could} could "
            "re-gather a weight)"
        )
    if need <= limit:
        return plain, (
            f"{label}: compiled as written: it needs {regather_choice.gib(need)} a device, "
            f"within the {regather_choice.gib(limit)} a device holds ({could} could "
            "re-gather a weight)"
        )
    over = (
        f"{label}: the program as written needs {regather_choice.gib(need)} a device, over "
        f"the {regather_choice.gib(limit)} a device holds"
    )
    try:
        other_ctx, other_stage = rewrite(barriers, True)
        n = other_ctx.notes.get("regathered_products", 0)
        if not n:
            return plain, f"{over}; the weights could not be re-gathered: compiled as written"
        other = compile_stage(other_ctx, other_stage, "+regather-weights")
    except Exception as e:  # the program as written is compiled: keep it
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        warn_once(
            "regather-weights-compile",  # not the rewrite's own key: both may come up
            f"stepbundle kept {label} with its weights gathered once: the program with them "
            f"re-gathered did not compile ({why})",
        )
        return plain, f"{over}; the program with the weights re-gathered did not compile ({why})"
    after = regather_choice.memory_need(other[0])
    kept = after is not None and after <= need  # no worse by the analysis: the rewrite's aim
    return (other if kept else plain), (
        f"{over}; with the weights re-gathered for {_plural(n, 'product')} it needs "
        + (regather_choice.gib(after) if after is not None else "an unknown amount")
        + (": compiled with them" if kept else ": compiled as written")
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
