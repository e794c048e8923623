"""runtime/compile/fused_attention.py's kernels on their own, under Pallas's interpreter on the CPU.

The whole rewrite (matching, splicing, a training step against float64 PyTorch) is
tests/exporter/test_fused_attention.py's; these check the kernels' settings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stepbundle.runtime.compile import fused_attention as fa
from stepbundle.stablehlo.attention import Site


def test_both_layouts_of_k_and_v_are_as_close_to_float64_as_bf16_allows() -> None:
    # k and v are held sequence-minor by default (faster on a TPU). A layout changes the
    # kernels' order of work (bf16 results may differ by an ulp): each must be as close
    # to float64 attention (numpy) as bf16 allows.
    assert fa.block_sizes(256)["k_layout"] == fa.block_sizes(256)["v_layout"] == "SEQ_MINOR"
    assert fa.block_sizes(640)["block_q"] == 128  # the largest block (<= 512) dividing it
    b, h, t, d = 1, 2, 256, 64
    site = Site(b, h, t, d, "bf16", "f32", True, *([None] * 5), do=None)
    key = jax.random.split(jax.random.key(3), 4)
    q, v, do = (jax.random.normal(k, (b * h, t, d), jnp.bfloat16) for k in key[:3])
    kt = jax.random.normal(key[3], (b * h, d, t), jnp.bfloat16)
    scale = 0.125

    q64, kt64, v64, do64 = (np.asarray(x, np.float64) for x in (q, kt, v, do))
    s64 = q64 @ kt64 * scale
    s64 = np.where(np.tril(np.ones((t, t), bool)), s64, -np.inf)
    p64 = np.exp(s64 - s64.max(-1, keepdims=True))
    p64 /= p64.sum(-1, keepdims=True)
    dp = do64 @ v64.transpose(0, 2, 1)
    ds = p64 * (dp - (dp * p64).sum(-1, keepdims=True)) * scale  # softmax's vjp
    tr = (0, 2, 1)
    want = [p64 @ v64, ds @ kt64.transpose(tr), q64.transpose(tr) @ ds, p64.transpose(tr) @ do64]

    texts = []
    for tuning in (None, {"k_layout": "HEAD_DIM_MINOR", "v_layout": "HEAD_DIM_MINOR"}):
        # The tuning reaches the kernels: lowered for a TPU, the two programs differ.
        traced = jax.jit(fa.attention_function(site, tuning=tuning)).trace(
            q, kt, v, jnp.float32(scale)
        )
        texts.append(traced.lower(lowering_platforms=("tpu",)).as_text())
        attention = fa.attention_function(site, interpret=True, tuning=tuning)
        out, pullback = jax.vjp(attention, q, kt, v, jnp.float32(scale))
        got = [np.asarray(x, np.float64) for x in (out, *pullback(do)[:3])]
        for name, g, w in zip(("o", "dq", "dkt", "dv"), got, want):
            # bf16 results: within one bf16 ulp (2**-7) of the largest value
            assert np.abs(g - w).max() <= 2**-7 * np.abs(w).max(), (tuning, name)
    assert texts[0] != texts[1]
