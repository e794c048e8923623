"""The fused attention functions that ``stablehlo/attention_rewrite.py`` splices into a program.

On a TPU the runtime swaps a training step's traced attention for jax's splash-attention
Pallas kernels (``jax.experimental.pallas.ops.tpu.splash_attention``): block-sparse
flash attention, which never writes the (T, T) scores and skips the blocks above a
causal diagonal. The forward function is ``jax.vjp`` of the kernel applied to
``q * scale``, returning the output and the pullback's residuals (a ``jax.vjp`` pullback
is a pytree whose leaves are exactly those); the backward function rebuilds the pullback
from them and applies it to the output's gradient. Both are lowered with ``jax.jit`` for
the program's platform and handed over as MLIR text.

Block sizes: one block of up to 512 along each sequence, measured on a TPU v5e on the
55M GPT of ``benchmarks/device/gpt.py`` (context 512) written in JAX: 33.5 ms per step
with blocks of 512, 37.0 with 256, 48.3 with 128 (gpt-splash.json). The fused backward
kernel (one kernel for dq, dk and dv) is used.

``interpret=True`` runs the same kernels through Pallas's interpreter: the CPU tests
check the whole rewrite with it; it is never used to train.

Imports: jax (its Pallas kernels), numpy.
"""

from __future__ import annotations

from typing import Any

from stepbundle.stablehlo.attention import Site

__all__ = ["BLOCK", "kernels_for", "supported"]

BLOCK = 512
"""The largest block along each sequence; smaller contexts use their length."""

K_LAYOUT = "HEAD_DIM_MINOR"
"""How the kernels hold k: ``HEAD_DIM_MINOR`` (t, d) or ``SEQ_MINOR`` (d, t), the way
the traced program holds it (``kt``), which might save a layout copy per layer;
``benchmarks/device/gpt.py bench --peers bundle_kseq`` compares them (not measured yet:
the session's device time ran out)."""


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


def kernels_for(platform: str, interpret: bool = False) -> Any:
    """A ``stablehlo.attention_rewrite.Kernels`` callable for ``platform`` (``tpu``; ``cpu``
    with ``interpret=True`` in tests)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as sm,
    )

    dtypes = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16, "f64": jnp.float64}

    def lower(fn: Any, *avals: Any) -> str:
        # keep_unused: the program calls with every argument. No traceback in the
        # locations: the kernels' bytes (part of the compile cache's key) would
        # otherwise name the calling script's file and line.
        config: Any = jax.config
        limit = config.jax_traceback_in_locations_limit
        config.update("jax_traceback_in_locations_limit", 0)
        try:
            traced = jax.jit(fn, keep_unused=True).trace(*avals)
            return str(traced.lower(lowering_platforms=(platform,)).as_text())
        finally:
            config.update("jax_traceback_in_locations_limit", limit)

    def make(site: Site) -> tuple[str, str | None]:
        b, h, t, d = site.batch, site.heads, site.length, site.head_dim
        dt, st = dtypes[site.dtype], dtypes[site.scale_dtype]
        one = sm.CausalMask((t, t)) if site.causal else sm.FullMask((t, t))
        blk = _block(t)
        kernel = sk.make_splash_mha(
            mask=sm.MultiHeadMask([one for _ in range(h)]),
            block_sizes=sk.BlockSizes(
                block_q=blk,
                block_kv=blk,
                block_q_dkv=blk,
                block_kv_dkv=blk,
                use_fused_bwd_kernel=True,
                k_layout=getattr(sk.QKVLayout, K_LAYOUT),
            ),
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )

        def attention(q: Any, kt: Any, v: Any, scale: Any) -> Any:
            # (B*H, T, D) and kt (B*H, D, T), as the program holds them; the scale is
            # applied in q's type, as the program applied it to the scores' type.
            s32 = scale.astype(jnp.float32)
            q32 = q.astype(jnp.float32)
            q4 = (q32 / s32 if site.divides else q32 * s32).astype(dt)
            q4 = q4.reshape(b, h, t, d)
            k4 = jnp.swapaxes(kt, 1, 2).reshape(b, h, t, d)
            return jax.vmap(kernel)(q4, k4, v.reshape(b, h, t, d)).reshape(b * h, t, d)

        aval: Any = jax.ShapeDtypeStruct
        qs, kts, ss = aval((b * h, t, d), dt), aval((b * h, d, t), dt), aval((), st)
        if site.do is None:
            return lower(attention, qs, kts, qs, ss), None
        trees: list[Any] = []

        def forward(q: Any, kt: Any, v: Any, scale: Any) -> Any:
            out, pullback = jax.vjp(lambda q, kt, v: attention(q, kt, v, scale), q, kt, v)
            leaves, tree = jax.tree_util.tree_flatten(pullback)
            trees.append(tree)  # static: the same on every trace
            return out, leaves

        out_aval, leaves = jax.eval_shape(forward, qs, kts, qs, ss)

        def backward(residuals: Any, do: Any) -> Any:
            return jax.tree_util.tree_unflatten(trees[0], residuals)(do)

        return lower(forward, qs, kts, qs, ss), lower(backward, leaves, out_aval)

    return make
