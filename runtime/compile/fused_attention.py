"""The fused attention functions that ``stablehlo/attention_rewrite.py`` splices into a program.

On a TPU the runtime swaps a training step's traced attention for jax's splash-attention
Pallas kernels (``jax.experimental.pallas.ops.tpu.splash_attention``): block-sparse
flash attention, which never writes the (T, T) scores and skips the blocks above a
causal diagonal. The forward function is ``jax.vjp`` of the kernel applied to
``q * scale``, returning the output and the pullback's residuals (a ``jax.vjp`` pullback
is a pytree whose leaves are exactly those); the backward function rebuilds the pullback
from them and applies it to the output's gradient. Both are lowered with ``jax.jit`` for
the program's platform and handed over as MLIR text.

Block sizes: one block of up to 512 along each sequence, the fastest measured on a TPU
v5e (the 55M GPT of ``benchmarks/device/gpt.py`` and the kernels alone,
``benchmarks/device/splash_sweep.py``; docs/tpu.md has the figures). The fused backward
kernel (one kernel for dq, dk and dv) is used, and k and v are held sequence-minor
(``block_sizes``).

``interpret=True`` runs the same kernels through Pallas's interpreter: the CPU tests
check the whole rewrite with it; it is never used to train.

Imports: jax (its Pallas kernels).
"""

from __future__ import annotations

from typing import Any

from stepbundle.stablehlo.attention import Site
from stepbundle.stablehlo.attention_composite import Attention

__all__ = [
    "BLOCK",
    "TUNING",
    "attention_function",
    "block_sizes",
    "composite_kernel",
    "composite_avals",
    "composite_kernels_for",
    "compute_dtype",
    "composite_supported",
    "kernels_for",
    "supported",
]

BLOCK = 512
"""The largest block along each sequence; smaller contexts use their length."""

TUNING: dict[str, Any] = {}
"""Fields of splash's ``BlockSizes`` to set instead of the defaults above, for
benchmarks: ``benchmarks/device/gpt.py bench --variant NAME=JSON`` loads the bundle with
them (layouts by name, e.g. ``{"k_layout": "SEQ_MINOR"}``), and
``benchmarks/device/splash_sweep.py`` times the kernels alone under each."""


def block_sizes(length: int, tuning: dict[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments of splash's ``BlockSizes`` for a context of ``length``."""
    blk = _block(length)
    sizes: dict[str, Any] = {
        "block_q": blk,
        "block_kv": blk,
        "block_q_dkv": blk,
        "block_kv_dkv": blk,
        "use_fused_bwd_kernel": True,
        # k and v held sequence-minor, (d, t), inside the kernels: the program holds k
        # so already (kt), and the GPT stepped faster so than with either in (t, d)
        # (docs/tpu.md).
        "k_layout": "SEQ_MINOR",
        "v_layout": "SEQ_MINOR",
    }
    sizes.update(TUNING if tuning is None else tuning)
    return sizes


_NAMES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16", "f64": "float64"}
"""MLIR's element type names, as jax (``jnp.dtype``) spells them."""


def supported(site: Site) -> str | None:
    """Why ``site`` keeps its traced attention, or None when the kernels take it."""
    if site.dtype != "bf16":  # the case measured; float32 products in a kernel, not yet
        return f"q is {site.dtype}, not bf16"
    if site.scale_dtype not in ("f32", "bf16", "f16"):
        return f"the scale is {site.scale_dtype}"
    if site.length % 128:
        return f"the context ({site.length}) is not a multiple of 128"
    if site.head_dim % 64:
        return f"the head size ({site.head_dim}) is not a multiple of 64"
    return None


def _block(length: int) -> int:
    b = min(BLOCK, length)
    while length % b:
        b //= 2
    return b


def attention_function(
    site: Site, interpret: bool = False, tuning: dict[str, Any] | None = None
) -> Any:
    """The jax function the program calls in place of ``site``'s attention:
    ``(q, kt, v, scale) -> o`` on the program's (B*H, T, D) and (B*H, D, T) arrays.
    ``tuning`` overrides the block sizes and layouts (default: ``TUNING``)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as sm,
    )

    b, h, t, d = site.batch, site.heads, site.length, site.head_dim
    dt = jnp.dtype(_NAMES[site.dtype])
    one = sm.CausalMask((t, t)) if site.causal else sm.FullMask((t, t))
    sizes = block_sizes(t, tuning)
    for key in ("q_layout", "k_layout", "v_layout"):
        if isinstance(sizes.get(key), str):
            sizes[key] = getattr(sk.QKVLayout, sizes[key])
    kernel = sk.make_splash_mha(
        mask=sm.MultiHeadMask([one for _ in range(h)]),
        block_sizes=sk.BlockSizes(**sizes),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )

    def attention(q: Any, kt: Any, v: Any, scale: Any) -> Any:
        # The scale is applied to q in float32, rounded once to q's type.
        s32 = scale.astype(jnp.float32)
        q32 = q.astype(jnp.float32)
        q4 = (q32 / s32 if site.divides else q32 * s32).astype(dt)
        q4 = q4.reshape(b, h, t, d)
        k4 = jnp.swapaxes(kt, 1, 2).reshape(b, h, t, d)
        return jax.vmap(kernel)(q4, k4, v.reshape(b, h, t, d)).reshape(b * h, t, d)

    return attention


def kernels_for(platform: str, interpret: bool = False) -> Any:
    """A ``stablehlo.attention_rewrite.Kernels`` callable for ``platform`` (``tpu``; ``cpu``
    with ``interpret=True`` in tests)."""
    import jax
    import jax.numpy as jnp

    def make(site: Site) -> tuple[str, str | None]:
        b, h, t, d = site.batch, site.heads, site.length, site.head_dim
        dt, st = (jnp.dtype(_NAMES[x]) for x in (site.dtype, site.scale_dtype))
        attention = attention_function(site, interpret)
        aval: Any = jax.ShapeDtypeStruct
        qs, kts, ss = aval((b * h, t, d), dt), aval((b * h, d, t), dt), aval((), st)
        if site.do is None:
            return _lower(attention, platform, qs, kts, qs, ss), None
        trees: list[Any] = []

        def forward(q: Any, kt: Any, v: Any, scale: Any) -> Any:
            out, pullback = jax.vjp(lambda q, kt, v: attention(q, kt, v, scale), q, kt, v)
            leaves, tree = jax.tree_util.tree_flatten(pullback)
            trees.append(tree)  # static: the same on every trace
            return out, leaves

        out_aval, leaves = jax.eval_shape(forward, qs, kts, qs, ss)

        def backward(residuals: Any, do: Any) -> Any:
            return jax.tree_util.tree_unflatten(trees[0], residuals)(do)

        return _lower(forward, platform, qs, kts, qs, ss), _lower(
            backward, platform, leaves, out_aval
        )

    return make


# ------------------------------------------------------- attention composites (SDPA)
PAD_TO = 128
"""Sequences are padded to a multiple of this for the kernels (the padding masked)."""

HEAD_SIZES = (64, 128, 256)


def composite_supported(att: Attention) -> str | None:
    """Why an attention composite keeps its decomposition (in words a user can act on),
    or None when the kernels take it."""
    if att.dropout_p:
        return f"dropout on the attention probabilities (p={att.dropout_p:g}) is not fused"
    if att.mask in ("boolean", "additive"):
        article = "an" if att.mask == "additive" else "a"
        return (
            f"{article} {att.mask} attn_mask that is not the causal triangle when the program "
            "is compiled is not fused (made from the step's inputs, too large to compute, "
            "or another mask; for causal attention pass is_causal=True)"
        )
    if att.mask not in ("none", "causal"):
        return f"the mask kind {att.mask!r} is unknown"
    if any(t not in KERNEL_TYPES for t in att.dtypes()):
        q, k, v = att.dtypes()
        return (
            f"q, k and v are {q}, {k} and {v}: the kernels take bf16 and f32 (run the model "
            "under bf16 autocast)"
        )
    if att.head_dim not in HEAD_SIZES or att.v_dim != att.head_dim:
        return f"the head size ({att.head_dim}, v {att.v_dim}) is not one of {HEAD_SIZES}"
    if att.kv_heads < 1 or att.heads % att.kv_heads or att.heads // att.kv_heads != att.groups:
        return f"{att.heads} query heads do not share {att.kv_heads} key/value heads evenly"
    return None


KERNEL_TYPES = ("bf16", "f32")
"""The element types of q, k and v the kernels take."""

FLOAT32_COMPUTE = "bf16"
"""What a composite with a float32 q, k or v computes in inside the kernels: ``"bf16"``
(its operands rounded to bf16, and the kernels' results, the output and each gradient,
rounded to bf16 before they are given back in the composite's types) or ``"f32"``.
torch_xla does not autocast SDPA, so a model under bf16 autocast can hand it float32
operands (Hugging Face's Llama: q and k come out of the float32 rotary embedding, v is
bf16). Fused attention runs at the default precision only, where a TPU's float32 product
rounds its operands to bf16 as well (its sums stay float32); on the v5e the two gave the
Llama the same first loss and bf16 the faster step (docs/tpu.md). On the CPU (kernels
interpreted, float32 decomposition) bf16 moves a step further from float64 than float32
does (``tests/exporter/test_sdpa_composite_xla.py``, form ``f32-qk``)."""


def compute_dtype(att: Attention) -> str:
    """The element type the kernels compute ``att`` in: bf16 when q, k and v all are,
    else ``FLOAT32_COMPUTE``."""
    return "bf16" if set(att.dtypes()) == {"bf16"} else FLOAT32_COMPUTE


def _padded(n: int) -> int:
    return -(-n // PAD_TO) * PAD_TO


def composite_kernel(
    att: Attention, interpret: bool = False, tuning: dict[str, Any] | None = None
) -> Any:
    """The jax function that replaces ``att``'s composite: the forward ``(q, k, v) ->
    (out, lse)``, or the backward ``(dout, q, k, v, out, lse) -> (dq, dk, dv)`` (it
    recomputes the forward through the kernels' own vjp; ``out`` and ``lse`` are not
    read), on the composite's (B, H, T, D) arrays."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as sm,
    )

    h, tq, tk = att.heads, att.q_len, att.kv_len
    pq, pk = _padded(tq), _padded(tk)
    if (pq, pk) == (tq, tk):
        one: Any = sm.CausalMask((tq, tk)) if att.causal else sm.FullMask((tq, tk))
    else:  # the padded keys masked; PyTorch's causal mask is the top-left triangle
        rows, cols = np.arange(pq)[:, None], np.arange(pk)[None, :]
        keep = (cols < tk) & ((cols <= rows) if att.causal else True)
        one = sm.NumpyMask(np.broadcast_to(keep, (pq, pk)).copy())
    sizes: dict[str, Any] = {
        "block_q": _block(pq),
        "block_kv": _block(pk),
        "block_q_dkv": _block(pq),
        "block_kv_dkv": _block(pk),
        "use_fused_bwd_kernel": True,
    }
    sizes.update(TUNING if tuning is None else tuning)
    for key in ("q_layout", "k_layout", "v_layout"):
        if isinstance(sizes.get(key), str):
            sizes[key] = getattr(sk.QKVLayout, sizes[key])

    def make(save_residuals: bool) -> Any:
        return sk.make_splash_mha(
            mask=sm.MultiHeadMask([one for _ in range(h)]),
            block_sizes=sk.BlockSizes(**sizes),
            head_shards=1,
            q_seq_shards=1,
            save_residuals=save_residuals,
            interpret=interpret,
        )

    dt = jnp.dtype(_NAMES[compute_dtype(att)])

    def prepare(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
        # The scale is applied to q in float32, rounded once to the kernels' type;
        # grouped key/value heads repeated (their gradients summed back by the vjp), in
        # the wider of the operand's type and the kernels', then converted: the groups'
        # gradients are summed in that type (a float32 k's in float32 when the kernels
        # compute in bf16; a bf16 v's in float32 when they compute in float32), and
        # rounded to the operand's type once.
        q = (q.astype(jnp.float32) * jnp.float32(att.scale)).astype(dt)
        k, v = (x.astype(jnp.promote_types(x.dtype, dt)) for x in (k, v))
        if att.groups > 1:
            k, v = (jnp.repeat(x, att.groups, axis=1) for x in (k, v))
        k, v = k.astype(dt), v.astype(dt)
        pad = ((0, 0), (0, 0))
        q = jnp.pad(q, (*pad, (0, pq - tq), (0, 0)))
        k, v = (jnp.pad(x, (*pad, (0, pk - tk), (0, 0))) for x in (k, v))
        return q, k, v

    if not att.grad:
        kernel = make(True)

        def forward(q: Any, k: Any, v: Any) -> Any:
            out, (lse,) = jax.vmap(kernel)(*prepare(q, k, v))
            out_type = jnp.result_type(q.dtype, k.dtype, v.dtype)  # as the composite's
            return out[:, :, :tq].astype(out_type), lse[:, :, :tq].astype(jnp.float32)

        return forward
    kernel = make(False)

    def backward(do: Any, q: Any, k: Any, v: Any, out: Any, lse: Any) -> Any:
        def attention(q: Any, k: Any, v: Any) -> Any:
            return jax.vmap(kernel)(*prepare(q, k, v))[:, :, :tq]

        _, pullback = jax.vjp(attention, q, k, v)
        dq, dk, dv = pullback(do.astype(dt))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    return backward


def composite_kernels_for(platform: str, interpret: bool = False) -> Any:
    """A ``stablehlo.attention_composite.Kernels`` callable for ``platform``."""

    def make(att: Attention) -> str:
        q, k, v, out, lse = composite_avals(att)
        fn = composite_kernel(att, interpret)
        if not att.grad:
            return _lower(fn, platform, q, k, v)
        return _lower(fn, platform, out, q, k, v, out, lse)

    return make


def composite_avals(att: Attention) -> tuple[Any, ...]:
    """The ``jax.ShapeDtypeStruct`` of ``att``'s q, k, v, output and lse."""
    import jax
    import jax.numpy as jnp

    b = att.batch
    qt, kt, vt = (jnp.dtype(_NAMES[t]) for t in att.dtypes())
    aval: Any = jax.ShapeDtypeStruct
    q = aval((b, att.heads, att.q_len, att.head_dim), qt)
    k = aval((b, att.kv_heads, att.kv_len, att.head_dim), kt)
    v = aval((b, att.kv_heads, att.kv_len, att.v_dim), vt)
    out = aval((b, att.heads, att.q_len, att.v_dim), jnp.result_type(qt, kt, vt))
    return q, k, v, out, aval((b, att.heads, att.q_len), jnp.float32)


def _lower(fn: Any, platform: str, *avals: Any) -> str:
    """``fn`` lowered for ``platform`` as MLIR text, every argument kept."""
    import jax

    # No traceback in the locations: the kernels' bytes (part of the compile cache's
    # key) would otherwise name the calling script's file and line.
    config: Any = jax.config
    limit = config.jax_traceback_in_locations_limit
    config.update("jax_traceback_in_locations_limit", 0)
    try:
        traced = jax.jit(fn, keep_unused=True).trace(*avals)
        return str(traced.lower(lowering_platforms=(platform,)).as_text())
    finally:
        config.update("jax_traceback_in_locations_limit", limit)
