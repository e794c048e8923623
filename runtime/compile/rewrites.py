"""The rewrite pipeline: what the runtime changes in a checked program before compiling it.

``REWRITES`` is an ordered table of named rewrites. Each is a small function
``(Stage, RewriteContext) -> Stage`` that decides for itself whether it applies (a
platform, an option) and returns the stage unchanged when it does not. A rewrite may
edit ``stage.module`` in place, or return a new module with the ``Program`` record that
describes its arguments and results (as the state-packing and K-step wrappers do).

Adding one is one function and one line in ``REWRITES``, e.g. a TPU-only rewrite::

    def my_rewrite(stage: Stage, ctx: RewriteContext) -> Stage:
        if ctx.platform == "tpu":
            ...  # edit stage.module in place
        return stage

    REWRITES = (..., ("my-rewrite", my_rewrite), ...)

Where a line goes matters:
- rewrites of the step's own operations (precision, RNG algorithm, convolutions) go
  after ``strip-attributes`` and before ``pack-state``, which wraps ``@main`` in a
  function that takes the packed buffers (the step's ops then sit in a callee);
- ``aliasing-and-sharding`` stays last: it annotates the final ``@main``'s arguments
  and results, from the final ``Program`` record.

The rewritten bytecode is the compile cache's key (``compile_cache.py``), so a new or
changed rewrite can never be served an executable compiled without it; no cache version
bump is needed for a rewrite. A rewrite must depend only on what ``RewriteContext``
holds (everything in it is in the key, directly or through the bytecode).

Imports: stepbundle.schema, stepbundle.stablehlo, the runtime's wrappers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

from stepbundle.schema.manifest import StateInput, StateUpdateOutput
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.attention import Site, count_score_products
from stepbundle.stablehlo.attention_composite import count_composites, rewrite_composites
from stepbundle.stablehlo.attention_rewrite import rewrite_attention
from stepbundle.stablehlo.bf16_products import count_bf16_products, rewrite_bf16_products
from stepbundle.stablehlo.blocked_sums import block_long_sums, count_long_sums
from stepbundle.stablehlo.conv_layout import canonicalize_convolutions
from stepbundle.stablehlo.conv_wgrad import count_weight_gradients, rewrite_weight_gradients
from stepbundle.stablehlo.head_barriers import rewrite_head_barriers
from stepbundle.stablehlo.onehot import count_onehot_reductions, rewrite_onehot_reductions
from stepbundle.stablehlo.pow_precision import rewrite_powers
from stepbundle.stablehlo.precision import set_matmul_precision
from stepbundle.stablehlo.regather import count_regathers, rewrite_regathers
from stepbundle.stablehlo.rng_algorithm import pin_rng_algorithm

from ..fallback import warn_once
from ..placement import packing
from ..placement.layout_spec import DataSplit
from ..placement.shard_plan import DATA
from ..placement.sharding import MESH
from . import multistep
from .mesh_attention import declares_mesh
from .stage import RewriteContext, Stage
from .state_masks import argument_names

__all__ = ["REWRITES", "Rewrite", "RewriteContext", "Stage", "apply_rewrites"]


Rewrite = Callable[[Stage, RewriteContext], Stage]


def strip_attributes(stage: Stage, ctx: RewriteContext) -> Stage:
    """Drop the module's own aliasing and sharding attributes: they are never trusted,
    and ``aliasing-and-sharding`` regenerates them from the manifest."""
    stage.module.strip_attributes()
    return stage


def matmul_precision(stage: Stage, ctx: RewriteContext) -> Stage:
    """Set ``precision_config`` on every dot_general and convolution."""
    if ctx.matmul_precision is not None:
        set_matmul_precision(stage.module, ctx.matmul_precision)
    return stage


def rng_algorithm(stage: Stage, ctx: RewriteContext) -> Stage:
    """One random-bit algorithm on every backend: DEFAULT is Philox on the CPU and
    something else on a TPU (``stablehlo/rng_algorithm.py`` says what was measured)."""
    pin_rng_algorithm(stage.module)
    return stage


def power_precision(stage: Stage, ctx: RewriteContext) -> Stage:
    """On accelerators under "high" or "highest" (what a comparison with a CPU asks for),
    small float32 powers (Adam's bias corrections) exactly: a TPU's float32 power was up
    to 52 ulp off, which moved Adam's losses 4e-5 from the CPU's in 5 steps
    (``stablehlo/pow_precision.py`` has the figures). At the default precision a TPU's
    bf16 matmul passes are the larger error, and the rewrite would only cost compile
    time; a CPU's power is within an ulp already."""
    if ctx.platform != "cpu" and ctx.matmul_precision in ("high", "highest"):
        copy = mlir.Module.parse_text(stage.module, stage.module.text())
        try:
            if rewrite_powers(copy):
                return Stage(copy, stage.program)
        except ValueError as e:  # a form the rewrite does not handle: keep the program as is
            warn_once(
                "power-precision",
                f"stepbundle kept a program's float32 powers as the backend computes them: {e}",
            )
    return stage


def onehot_sums(stage: Stage, ctx: RewriteContext) -> Stage:
    """On every platform, sums over a one-hot of the targets (torch_xla's cross-entropy
    loss) as the values at the targets: each was a pass over (tokens x vocabulary), a few
    percent of a 55M GPT's step on a TPU v5e apiece (``stablehlo/onehot.py``; docs/tpu.md
    has the figures). The per-token values are exact; the loss adds them in another
    order."""
    try:
        if not count_onehot_reductions(stage.module):
            return stage
        copy = mlir.Module.parse_text(stage.module, stage.module.text())
        rewrite_onehot_reductions(copy)
    except Exception as e:  # any failure keeps the program as it is: it is only slower
        warn_once("onehot-sums", f"stepbundle kept a program's one-hot sums as they are: {e}")
        return stage
    return Stage(copy, stage.program)


def blocked_sums(stage: Stage, ctx: RewriteContext) -> Stage:
    """On the CPU, long float32 (and bf16/f16) sums in blocks of at most 64 values, summed
    again in blocks: a cascade, as PyTorch's CPU sum adds, so that a BatchNorm's sums over
    N*H*W values are as accurate whichever kernel XLA:CPU picks for them, its own loops or
    YNNPACK's (``stablehlo/blocked_sums.py``; docs/numerics.md has the figures). TPUs and
    GPUs sum in trees already. ``STEPBUNDLE_CPU_BLOCKED_SUMS=0`` switches it off
    (``cpu_numerics.py``)."""
    if ctx.platform != "cpu" or not ctx.blocked_sums:
        return stage
    try:
        if not count_long_sums(stage.module):
            return stage
        copy = mlir.Module.parse_text(stage.module, stage.module.text())
        ctx.notes["blocked_sums"] = block_long_sums(copy)
    except Exception as e:  # any failure keeps the program as it is: it is only less accurate
        warn_once("blocked-sums", f"stepbundle kept a program's long sums as they are: {e}")
        return stage
    return Stage(copy, stage.program)


def weight_gradients(stage: Stage, ctx: RewriteContext) -> Stage:
    """On TPUs, weight-gradient convolutions (a map-sized window) as a loop over rows: they
    took the TPU compiler far longer than the eval program (docs/tpu.md, "Compile time",
    has the figures)."""
    if ctx.platform != "tpu":
        return stage
    try:
        if not count_weight_gradients(stage.module):
            return stage  # no copy of a program without one (a GPT's)
        copy = mlir.Module.parse_text(stage.module, stage.module.text())
        rewrite_weight_gradients(copy)
        return Stage(copy, stage.program)
    except Exception as e:  # any failure keeps the program as it is: it only compiles slower
        warn_once(
            "weight-gradients",
            f"stepbundle kept a program's weight-gradient convolutions as they are: {e}",
        )
    return stage


def fused_attention(stage: Stage, ctx: RewriteContext) -> Stage:
    """On a TPU at the default precision, traced attention (bf16, causal or unmasked)
    as jax's splash-attention kernels, forward and backward: the (T, T) score matrices
    took about a third of a 55M GPT's step on a v5e (docs/tpu.md; ``stablehlo/attention.py``,
    ``runtime/compile/fused_attention.py``). Not under "high"/"highest" (the kernels' products
    are bf16). Over several devices, attention composites only, one kernel call per
    shard (``runtime/compile/mesh_attention.py``: a Pallas call is not partitioned)."""
    if ctx.platform != "tpu" or not ctx.fused_attention:
        return stage
    if ctx.matmul_precision in ("high", "highest"):
        if count_composites(stage.module) or count_score_products(stage.module):
            why = (
                f"the matmul precision is '{ctx.matmul_precision}', and the kernels compute "
                "bf16 products (a torch front-end bundle records torch's float32 default, "
                "'highest'); load it with matmul_precision='default' (--matmul-precision "
                "default) to fuse its attention (docs/tpu.md)"
            )
            ctx.kept_attention.append(f"every attention: {why}")
            warn_once("fused-attention-precision", f"stepbundle kept traced attention: {why}")
        return stage
    return fuse_attention(stage, ctx, ctx.platform)


def head_barriers(stage: Stage, ctx: RewriteContext) -> Stage:
    """Optimization barriers on the output head's products' activations and input
    gradient (``stablehlo/head_barriers.py``), where ``compile_program`` found XLA fusing
    the residual stream into the head (``head_choice.py``). Identity on values."""
    if ctx.head_barriers:
        ctx.notes["head_barriers"] = rewrite_head_barriers(stage.module, "hidden")
    return stage


def bf16_products(stage: Stage, ctx: RewriteContext) -> Stage:
    """On a TPU, each bf16 x bf16 product written float32-out whose one use rounds it to
    bf16 (the torch front-end's form of an autocast product: PyTorch's CPU accumulates
    in float32 and rounds once) as a bf16-out product (torch_xla's form), and the weight
    gradients among them, ``g.t() @ x``, as ``(x.t() @ g).t()``
    (``stablehlo/bf16_products.py``). The same bits for each product on a v5e's matrix
    unit (measured there only); fewer relayouts and float32 temporaries (docs/tpu.md). A
    product with a bias added in float32 before the rounding is left as written. Not on a
    CPU, whose bf16-out product rounds otherwise, and not over several devices: there the
    partitioner would sum a product's partial sums after it, in bf16 where the product is
    bf16-out (not measured). Runs after ``fused-attention``, whose matchers read the
    program as the front-end wrote it, and before ``head-barriers``."""
    if ctx.platform != "tpu" or not ctx.bf16_products or ctx.placement.partitioned:
        return stage
    try:
        if not count_bf16_products(stage.module):
            return stage
        copy = mlir.Module.parse_text(stage.module, stage.module.text())
        n, swapped = rewrite_bf16_products(copy)
    except Exception as e:  # any failure keeps the program as it is: it is only slower
        warn_once("bf16-products", f"stepbundle kept a program's bf16 products as written: {e}")
        return stage
    ctx.notes["bf16_products"], ctx.notes["bf16_weight_gradients"] = n, swapped
    return Stage(copy, stage.program)


def regather_weights(stage: Stage, ctx: RewriteContext) -> Stage:
    """Where the layout splits parameters over the data axis (``fsdp``, ``fsdp+tp``),
    each product of a parameter after its first reads its own copy, behind a barrier
    tied to that product's other operand (``stablehlo/regather.py``): the partitioner
    gathers the weight again for the backward pass instead of keeping the forward's
    gathered copy alive until then (#41: a layer's bf16 weights, 0.44 GB for Llama 3
    8B's, on every chip). Identity on values. Nothing on one device or under ``dp`` and
    ``zero1``, which split no parameter over the data axis. With
    ``ctx.regather_weights`` False the program is kept as written and
    ``notes["regather_sites"]`` says how many products the rewrite would give a copy
    (``compile_program``'s "auto" compiles the rewritten program only where there are
    some). A failure keeps the program as written (it only needs more memory), with a
    warning."""
    plan = ctx.placement.plan
    if plan is None or plan.layout.data != DataSplit.FSDP or plan.data < 2:
        return stage
    split = {name for name, dims in plan.dims.items() if DATA in dims}
    args = [
        i
        for i, row in enumerate(stage.program.inputs)
        if isinstance(row, StateInput) and row.name in split
    ]
    if not args:
        return stage
    if not ctx.regather_weights:
        # where counting fails, so would the rewrite: nothing to re-gather
        with contextlib.suppress(Exception):
            ctx.notes["regather_sites"] = count_regathers(stage.module, args)
        return stage
    try:
        copy = mlir.Module.parse_text(stage.module, stage.module.text())
        ctx.notes["regathered_products"] = rewrite_regathers(copy, args)
    except Exception as e:  # any failure keeps the program as it is: it only needs more memory
        warn_once("regather-weights", f"stepbundle kept a program's weights gathered once: {e}")
        return stage
    return Stage(copy, stage.program)


def fuse_attention(
    stage: Stage, ctx: RewriteContext, platform: str, interpret: bool = False
) -> Stage:
    """``fused_attention``'s rewrite, unconditionally (the CPU tests run it with the
    kernels interpreted). A failure warns once and keeps the program as it is."""
    if ctx.placement.partitioned:
        from .mesh_attention import fuse_on_mesh

        return fuse_on_mesh(stage, ctx, platform, interpret)
    from .fused_attention import kernels_for

    try:
        kernels = kernels_for(platform, interpret)
    except ImportError as e:  # a jax without the Pallas kernels
        warn_once("fused-attention", f"stepbundle kept traced attention as it is: {e}")
        return stage
    skipped: list[str] = []
    copy = mlir.Module.parse_text(stage.module, stage.module.text())
    scalars = dict(ctx.scalar_constants)
    reads: set[int] = set()  # state arguments a fused mask was computed from
    names = argument_names(stage.program)  # what a mask read, for the reasons
    composites = _fuse_composites(copy, platform, interpret, ctx.kept_attention, ctx, reads, names)
    if composites is None:  # a failure: the program is as it was
        return stage
    misses: list[str] = []  # attention seen and not taken, and why
    try:
        n = rewrite_attention(
            copy,
            kernels,
            scalars,
            accept=lambda s: _accept(s, skipped),
            misses=misses,
            state=ctx.state_values,
            state_reads=reads,
            names=names,
        )
    except Exception as e:  # lowering or verification: keep the traced attention
        warn_once("fused-attention", f"stepbundle kept traced attention as it is: {e}")
        if not composites:
            return stage
        copy, n = mlir.Module.parse_text(stage.module, stage.module.text()), 0
        reads = set()
        composites = _fuse_composites(copy, platform, interpret, [], ctx, reads, names) or 0
    n += composites
    ctx.kept_attention.extend(dict.fromkeys(misses))
    ctx.pinned_state.extend(ctx.state_values[i][0] for i in sorted(reads))
    if skipped:
        warn_once("fused-attention-skipped", "stepbundle kept traced attention: " + skipped[0])
    for miss in dict.fromkeys(misses):
        warn_once(
            f"fused-attention-missed:{miss}",
            f"stepbundle kept traced attention it did not recognize: {miss}",
        )
    if not skipped and not misses and count_score_products(stage.module) > 2 * n:
        warn_once(
            "fused-attention-unmatched",
            "stepbundle kept traced attention it did not recognize (batched products of a "
            "(T, T) score shape that are not the pattern it fuses; docs/tpu.md, 'Fused "
            "attention', says which forms are)",
        )
    ctx.notes["fused_attention"] = n
    return Stage(copy, stage.program) if n else stage


def _fuse_composites(
    module: mlir.Module,
    platform: str,
    interpret: bool,
    kept_out: list[str],
    ctx: RewriteContext,
    reads: set[int],
    names: Mapping[int, str] | None = None,
) -> int | None:
    """Attention composites (``stablehlo/attention_composite.py``: what a front-end
    writes for ``F.scaled_dot_product_attention``) as the kernels, in place where their
    attributes allow; each kept says where and why (a warning, once per reason). The
    number of forward attentions fused, or None when the rewrite failed (``module`` may
    then be partly rewritten); the sites kept, in words, are added to ``kept_out``. A
    mask that computes to the causal triangle (from constants, ``ctx``'s scalar
    constants and unwritten state) is fused as causal; the state arguments it was
    computed from are added to ``reads``."""
    from .fused_attention import composite_kernels_for, composite_supported

    if not count_composites(module):
        return 0
    try:
        fused, kept = rewrite_composites(
            module,
            composite_kernels_for(platform, interpret),
            composite_supported,
            dict(ctx.scalar_constants),
            ctx.state_values,
            reads,
            names,
        )
    except Exception as e:  # lowering or verification: keep the decompositions
        warn_once(
            "fused-attention-composite", f"stepbundle kept attention as its decomposition: {e}"
        )
        return None
    kept_out.extend(kept)
    for why in dict.fromkeys(kept):
        warn_once(
            f"fused-attention-kept:{why}",
            f"stepbundle kept attention as its decomposition (slower on a TPU): {why}",
        )
    return sum(1 for a in fused if not a.grad)


def _accept(site: Site, skipped: list[str]) -> bool:
    from .fused_attention import supported

    why = supported(site)
    if why is not None:
        skipped.append(why)
    return why is None


def pack_state(stage: Stage, ctx: RewriteContext) -> Stage:
    """Wrap the step in a function that takes and returns the state's packs."""
    if ctx.layout is None or not ctx.layout.packs:
        return stage
    return Stage(*packing.wrap_program(stage.module, stage.program, ctx.layout))


def canonical_convolutions(stage: Stage, ctx: RewriteContext) -> Stage:
    """With K > 1: XLA:CPU puts only the entry computation's convolutions in the order of
    its fast kernels; inside the loop they would run (and round) otherwise."""
    if ctx.steps_per_call > 1:
        canonicalize_convolutions(stage.module)
    return stage


def steps_per_call(stage: Stage, ctx: RewriteContext) -> Stage:
    """With K > 1, wrap the step in a loop of K steps over stacked batches."""
    if ctx.steps_per_call <= 1:
        return stage
    return Stage(*multistep.wrap_steps(stage.module, stage.program, ctx.steps_per_call))


def aliasing_and_sharding(stage: Stage, ctx: RewriteContext) -> Stage:
    """Donation from the manifest's alias table, and with several devices the mesh and
    every argument's and result's sharding."""
    module, program = stage.module, stage.program
    aliases: list[int | None] = [None] * len(program.inputs)
    if ctx.donate:
        for j, out in enumerate(program.outputs):
            if isinstance(out, StateUpdateOutput) and out.donates is not None:
                aliases[out.donates] = j
    placement = ctx.placement
    if placement.partitioned:
        if not declares_mesh(module, MESH):  # the fused attention's kernels declared it
            module.set_mesh(MESH, placement.mesh_axes)
        args, results = placement.annotations(program, stacked=ctx.steps_per_call > 1)
        module.set_arg_attributes(aliases, args)
        module.set_result_shardings(results)
    else:
        module.set_arg_attributes(aliases)
    return stage


# The pipeline, in order (see the module docstring for where a new line goes).
REWRITES: tuple[tuple[str, Rewrite], ...] = (
    ("strip-attributes", strip_attributes),
    ("rng-algorithm", rng_algorithm),
    ("matmul-precision", matmul_precision),
    ("power-precision", power_precision),
    ("onehot-sums", onehot_sums),
    ("blocked-sums", blocked_sums),
    ("weight-gradients", weight_gradients),
    ("fused-attention", fused_attention),
    ("bf16-products", bf16_products),
    ("head-barriers", head_barriers),
    ("regather-weights", regather_weights),
    ("pack-state", pack_state),
    ("canonical-convolutions", canonical_convolutions),
    ("steps-per-call", steps_per_call),
    ("aliasing-and-sharding", aliasing_and_sharding),
)


def apply_rewrites(
    stage: Stage, ctx: RewriteContext, rewrites: Sequence[tuple[str, Rewrite]] | None = None
) -> Stage:
    """Run ``rewrites`` (default: ``REWRITES``, read at call time) over ``stage`` in order."""
    for _, rewrite in REWRITES if rewrites is None else rewrites:
        stage = rewrite(stage, ctx)
    return stage
