"""Lowerings of aten's convolution, pooling and random-number operators.

Backward operators are the vector-Jacobian products of the forward lowerings
(``jax.vjp``), so a forward and its backward cannot disagree, except for max pooling:
torch sends a window's gradient to the first of its maxima (its saved ``indices``),
while jax's gradient of a max splits it between ties, which are common after a ReLU.
Max pooling therefore computes torch's indices and scatters through them.

Random operators draw from the key ``OpContext.key()`` gives them; ``lowering.py``
documents the rule that makes those keys from the program's seed input.

Imports: torch, jax, this package's registry and aten_math.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import lax

from stepbundle.stablehlo import attention_composite as ac

from .aten_math import HIGHEST, torch_dtype_of
from .registry import OpContext, compute_dtype, jax_dtype, lowers, to_dtype

aten = torch.ops.aten


def _per_dim(value: Any, n: int) -> tuple[int, ...]:
    vals = [int(v) for v in value] if isinstance(value, Sequence) else [int(value)]
    return tuple(vals * n) if len(vals) == 1 else tuple(vals)


# ------------------------------------------------------------------ convolution


def _conv(
    x: Any,
    w: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    preferred: Any,
) -> Any:
    nd = x.ndim - 2
    spatial = "DHW"[3 - nd :]
    dn = lax.conv_dimension_numbers(
        x.shape, w.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial)
    )
    return lax.conv_general_dilated(
        x,
        w,
        window_strides=stride,
        padding=[(p, p) for p in padding],
        rhs_dilation=dilation,
        dimension_numbers=dn,
        feature_group_count=groups,
        precision=HIGHEST,
        preferred_element_type=preferred,
    )


def _conv_forward(
    x: Any,
    w: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    groups: int,
    out_shape: tuple[int, ...],
    preferred: Any,
) -> Any:
    """torch's convolution (or transposed convolution), without the bias."""
    if x.ndim < 3:
        raise NotImplementedError("convolution of an unbatched input")
    nd = x.ndim - 2
    stride, padding, dilation = (_per_dim(v, nd) for v in (stride, padding, dilation))
    if not transposed:
        return _conv(x, w, stride, padding, dilation, groups, preferred)
    # A transposed convolution is the input-gradient of the convolution it inverts,
    # whose weight has exactly the transposed one's layout (in, out / groups, *kernel).
    z = jnp.zeros(out_shape, x.dtype)
    _, vjp = jax.vjp(lambda z: _conv(z, w, stride, padding, dilation, groups, None), z)
    (out,) = vjp(x.astype(jnp.result_type(z, w)))
    return out if preferred is None else out.astype(preferred)


def _preferred(dtype: torch.dtype) -> Any:
    return jnp.float32 if dtype in (torch.float16, torch.bfloat16) else None


@lowers(aten.convolution.default)
def _convolution(
    ctx: OpContext,
    x: Any,
    w: Any,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
) -> Any:
    dt = ctx.out_dtype
    x, w = to_dtype(x, dt), to_dtype(w, dt)
    out = _conv_forward(
        x, w, stride, padding, dilation, transposed, groups, ctx.out_shape, _preferred(dt)
    )
    if bias is not None:
        out = out + to_dtype(bias, compute_dtype(dt)).reshape((1, -1) + (1,) * (out.ndim - 2))
    return out


@lowers(aten.convolution_backward.default)
def _convolution_backward(
    ctx: OpContext,
    grad: Any,
    x: Any,
    w: Any,
    bias_sizes: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
    output_mask: Sequence[bool],
) -> Any:
    def forward(x: Any, w: Any) -> Any:
        return _conv_forward(
            x, w, stride, padding, dilation, transposed, groups, tuple(grad.shape), None
        )

    dt = jax_dtype(compute_dtype(torch_dtype_of(grad)))
    g = grad.astype(dt)
    _, vjp = jax.vjp(forward, x.astype(dt), w.astype(dt))
    gx, gw = vjp(g)
    gb = jnp.sum(g, axis=(0, *range(2, g.ndim))) if output_mask[2] else None
    return (gx if output_mask[0] else None, gw if output_mask[1] else None, gb)


# ---------------------------------------------------------------------- pooling


def _windows(
    x: Any,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    out_hw: tuple[int, int],
    pad_value: Any,
) -> tuple[Any, Any]:
    """Every pooling window of the last two axes of ``x``.

    Returns the windows' values, shape (..., K, out_h, out_w) with K = kh * kw in
    row-major kernel order (torch's scan order), and each value's flat position in the
    unpadded H x W plane, shape (K, out_h, out_w).
    """
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    (oh, ow), (h, w) = out_hw, x.shape[-2:]
    hi_h = max(0, (oh - 1) * sh + (kh - 1) * dh + 1 - ph - h)
    hi_w = max(0, (ow - 1) * sw + (kw - 1) * dw + 1 - pw - w)
    cfg = [(0, 0, 0)] * (x.ndim - 2) + [(ph, hi_h, 0), (pw, hi_w, 0)]
    xp = lax.pad(x, jnp.asarray(pad_value, x.dtype), cfg)
    values, where = [], []
    for i in range(kh):
        for j in range(kw):
            values.append(
                xp[..., i * dh : i * dh + (oh - 1) * sh + 1 : sh, j * dw : j * dw + (ow - 1) * sw + 1 : sw]
            )  # fmt: skip
            rows = jnp.arange(oh) * sh - ph + i * dh
            cols = jnp.arange(ow) * sw - pw + j * dw
            where.append(rows[:, None] * w + cols[None, :])
    return jnp.stack(values, axis=-3), jnp.stack(where)


def _pool_args(
    x: Any, kernel: Any, stride: Any, padding: Any, dilation: Any = 1
) -> tuple[Any, ...]:
    k = _per_dim(kernel, 2)
    s = _per_dim(stride, 2) if stride else k
    return k, s, _per_dim(padding, 2), _per_dim(dilation, 2)


@lowers(aten.max_pool2d_with_indices.default)
def _max_pool2d(
    ctx: OpContext,
    x: Any,
    kernel: Any,
    stride: Any = (),
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
) -> Any:
    k, s, p, d = _pool_args(x, kernel, stride, padding, dilation)
    shape = ctx.out_at(0).shape
    out_hw = (int(shape[-2]), int(shape[-1]))
    values, where = _windows(x, k, s, p, d, out_hw, -jnp.inf)
    which = jnp.argmax(values, axis=-3)  # the first maximum, as torch
    best = jnp.max(values, axis=-3)
    index = jnp.take_along_axis(
        jnp.broadcast_to(where, values.shape[:-3] + where.shape), which[..., None, :, :], axis=-3
    )[..., 0, :, :]
    return best, index.astype(jnp.int64)


@lowers(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(
    ctx: OpContext,
    grad: Any,
    x: Any,
    kernel: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    ceil_mode: bool,
    indices: Any,
) -> Any:
    lead = x.shape[:-2]
    plane = x.shape[-2] * x.shape[-1]
    rows = math.prod(lead)
    dt = compute_dtype(ctx.out_dtype)
    g = grad.reshape(rows, -1).astype(jax_dtype(dt))
    idx = indices.reshape(rows, -1)
    out = jnp.zeros((rows, plane), jax_dtype(dt))
    out = out.at[jnp.arange(rows)[:, None], idx].add(g)
    return out.reshape(x.shape)


def _avg_pool2d_forward(
    x: Any,
    kernel: Any,
    stride: Any,
    padding: Any,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: Any,
    out_hw: tuple[int, int],
) -> Any:
    k, s, p, d = _pool_args(x, kernel, stride, padding)
    values, _ = _windows(x, k, s, p, d, out_hw, 0)
    total = jnp.sum(values, axis=-3)
    if divisor_override:
        return total / divisor_override
    # torch's divisor: the window clipped to the padded input (count_include_pad),
    # or to the input itself.
    sizes = []
    for axis, n in enumerate(x.shape[-2:]):
        start = jnp.arange(out_hw[axis]) * s[axis] - p[axis]
        end = jnp.minimum(start + k[axis], n + p[axis])
        if count_include_pad:
            sizes.append(end - start)
        else:
            sizes.append(jnp.minimum(end, n) - jnp.maximum(start, 0))
    count = sizes[0][:, None] * sizes[1][None, :]
    return total / count.astype(total.dtype)


@lowers(aten.avg_pool2d.default)
def _avg_pool2d(
    ctx: OpContext,
    x: Any,
    kernel: Any,
    stride: Any = (),
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: Any = None,
) -> Any:
    dt = compute_dtype(ctx.out_dtype)
    out_hw = ctx.out_shape[-2:]
    return _avg_pool2d_forward(
        to_dtype(x, dt), kernel, stride, padding, ceil_mode, count_include_pad,
        divisor_override, (out_hw[0], out_hw[1]),
    )  # fmt: skip


@lowers(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(
    ctx: OpContext,
    grad: Any,
    x: Any,
    kernel: Any,
    stride: Any,
    padding: Any,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: Any,
) -> Any:
    dt = jax_dtype(compute_dtype(ctx.out_dtype))
    out_hw = (int(grad.shape[-2]), int(grad.shape[-1]))
    _, vjp = jax.vjp(
        lambda x: _avg_pool2d_forward(
            x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override, out_hw
        ),
        x.astype(dt),
    )
    (gx,) = vjp(grad.astype(dt))
    return gx


# -------------------------------------------------------------------- attention


def _attention(q: Any, k: Any, v: Any, is_causal: bool, mask: Any, scale: Any) -> tuple[Any, Any]:
    """softmax(q k^T * scale + mask) v and the rows' logsumexp, in q's dtype. Its
    operators, like the convolutions', are in ``export._PRODUCTS`` (the recorded precision)."""
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention: share each key/value head
        k = jnp.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
        v = jnp.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    s = (1.0 / (q.shape[-1] ** 0.5)) if scale is None else scale
    scores = jnp.einsum("...qd,...kd->...qk", q, k, precision=HIGHEST) * s
    if is_causal:
        lq, lk = scores.shape[-2:]
        keep = jnp.tril(jnp.ones((lq, lk), bool))
        scores = jnp.where(keep, scores, -jnp.inf)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf) if mask.dtype == jnp.bool_ else scores + mask
    lse = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.exp(scores - lse[..., None])
    return jnp.einsum("...qk,...kd->...qd", probs, v, precision=HIGHEST), lse


def _check_no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError("fused attention with dropout")


COMPOSITES = True
"""Write each attention as a ``stablehlo.composite`` (``stablehlo/attention_composite.py``)
whose decomposition is the lowering below; False writes the lowering alone (the tests
compare the two bit for bit)."""


def _mask_of(attn_mask: Any, dt: Any) -> Any:
    if attn_mask is None:
        return None
    return attn_mask.astype(jnp.bool_ if attn_mask.dtype == jnp.bool_ else dt)


def _composite(
    fn: Any, name: str, operands: list[Any], q: Any, k: Any, is_causal: bool, mask: Any,
    scale: Any, dropout_p: float,
) -> Any:  # fmt: skip
    """``fn(*operands)``, written as the attention composite ``name`` when COMPOSITES."""
    if not COMPOSITES:
        return fn(*operands)
    kind = "none" if mask is None else ("boolean" if mask.dtype == jnp.bool_ else "additive")
    if is_causal and mask is None:
        kind = "causal"
    attrs = ac.attributes(
        causal=is_causal,
        scale=(1.0 / (q.shape[-1] ** 0.5)) if scale is None else float(scale),
        mask=kind,
        dropout_p=dropout_p,
        groups=q.shape[-3] // k.shape[-3],
        q_len=q.shape[-2],
        kv_len=k.shape[-2],
    )
    return jax.lax.composite(lambda *xs, **_: fn(*xs), name, version=ac.VERSION)(*operands, **attrs)


@lowers(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_cpu(
    ctx: OpContext,
    q: Any,
    k: Any,
    v: Any,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: Any = None,
    scale: Any = None,
) -> Any:
    _check_no_dropout(dropout_p)
    dt = jax_dtype(compute_dtype(ctx.out_at(0).dtype))
    out_dt, lse_dt = (jax_dtype(ctx.out_at(i).dtype) for i in (0, 1))
    mask = _mask_of(attn_mask, dt)

    def forward(q: Any, k: Any, v: Any, *m: Any) -> Any:
        out, lse = _attention(
            q.astype(dt), k.astype(dt), v.astype(dt), is_causal, m[0] if m else None, scale
        )
        return out.astype(out_dt), lse.astype(lse_dt)

    # torch's kernel returns the output as (batch, seq, heads, dim) memory seen as
    # (batch, heads, seq, dim): values are what they are, the layout is torch's business.
    operands = [q, k, v] + ([] if mask is None else [mask])
    return _composite(forward, ac.NAME, operands, q, k, is_causal, mask, scale, dropout_p)


@lowers(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_cpu_backward(
    ctx: OpContext,
    grad: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: Any = None,
    scale: Any = None,
) -> Any:
    _check_no_dropout(dropout_p)
    dt = jax_dtype(compute_dtype(ctx.out_at(0).dtype))
    grad_dts = [jax_dtype(ctx.out_at(i).dtype) for i in range(3)]
    mask = _mask_of(attn_mask, dt)

    def backward(grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *m: Any) -> Any:
        # out and lse are the forward's (an operand of the composite, for a kernel that
        # reads them); the decomposition recomputes the forward instead.
        _, vjp = jax.vjp(
            lambda q, k, v: _attention(q, k, v, is_causal, m[0] if m else None, scale)[0],
            q.astype(dt), k.astype(dt), v.astype(dt),
        )  # fmt: skip
        return tuple(g.astype(t) for g, t in zip(vjp(grad.astype(dt)), grad_dts))

    operands = [grad, q, k, v, out, lse] + ([] if mask is None else [mask])
    return _composite(backward, ac.GRAD_NAME, operands, q, k, is_causal, mask, scale, dropout_p)


# --------------------------------------------------------------- random numbers


def _uniform(ctx: OpContext, low: float = 0.0, high: float = 1.0) -> Any:
    values = jax.random.uniform(ctx.key(), ctx.out_shape, jnp.float32, low, high)
    return values.astype(jax_dtype(ctx.out_dtype))


@lowers(aten.bernoulli.p)
def _bernoulli_p(ctx: OpContext, x: Any, p: float = 0.5, *, generator: Any = None) -> Any:
    _no_generator(generator)
    keep = jax.random.bernoulli(ctx.key(), p, ctx.out_shape)
    return keep.astype(jax_dtype(ctx.out_dtype))


@lowers(aten.bernoulli.default)
def _bernoulli(ctx: OpContext, probs: Any, *, generator: Any = None) -> Any:
    _no_generator(generator)
    u = jax.random.uniform(ctx.key(), ctx.out_shape, jnp.float32)
    return (u < probs.astype(jnp.float32)).astype(jax_dtype(ctx.out_dtype))


@lowers(aten.rand.default, aten.rand_like.default)
def _rand(ctx: OpContext, *args: Any, generator: Any = None, **kwargs: Any) -> Any:
    _no_generator(generator)
    return _uniform(ctx)


@lowers(aten.uniform.default)
def _uniform_op(
    ctx: OpContext, x: Any, low: float = 0.0, high: float = 1.0, *, generator: Any = None
) -> Any:
    _no_generator(generator)
    return _uniform(ctx, low, high)


@lowers(aten.randn.default, aten.randn_like.default)
def _randn(ctx: OpContext, *args: Any, generator: Any = None, **kwargs: Any) -> Any:
    _no_generator(generator)
    values = jax.random.normal(ctx.key(), ctx.out_shape, jnp.float32)
    return values.astype(jax_dtype(ctx.out_dtype))


def _no_generator(generator: Any) -> None:
    if generator is not None:
        raise NotImplementedError(
            "random numbers from an explicit torch.Generator (the bundle's random numbers "
            "come from its seed input; drop the generator= argument)"
        )
