"""Lowerings of aten's reductions: sums, means, extrema, variances, softmax.

Each computes in the dtype torch's kernel uses for its result (float32 for half types)
and the interpreter casts to torch's result dtype; a variance is two passes (the mean,
then squared deviations), as torch's kernels, so it does not cancel.

Imports: torch, jax, this package's registry and aten_math.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import lax

from .aten_math import _arith, _c
from .registry import OpContext, compute_dtype, lowers

aten = torch.ops.aten


# ------------------------------------------------------------------- reductions


def _axes(x: Any, dim: Any) -> tuple[int, ...]:
    """torch's ``dim`` argument of a reduction as jax axes; None or [] is every axis."""
    if dim is None:
        return tuple(range(x.ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return tuple(range(x.ndim))
    return tuple(sorted(d % max(x.ndim, 1) for d in dims)) if x.ndim else ()


@lowers(aten.sum.dim_IntList, aten.sum.default)
def _sum(
    ctx: OpContext, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> Any:
    (x,) = _arith(ctx, x)
    return jnp.sum(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.mean.dim, aten.mean.default)
def _mean(
    ctx: OpContext, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> Any:
    (x,) = _arith(ctx, x)
    return jnp.mean(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.prod.default, aten.prod.dim_int)
def _prod(
    ctx: OpContext, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None
) -> Any:
    (x,) = _arith(ctx, x)
    return jnp.prod(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.amax.default)
def _amax(ctx: OpContext, x: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return jnp.max(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.amin.default)
def _amin(ctx: OpContext, x: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return jnp.min(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.max.dim)
def _max_dim(ctx: OpContext, x: Any, dim: int, keepdim: bool = False) -> Any:
    return (
        jnp.max(x, axis=dim, keepdims=keepdim),
        jnp.argmax(x, axis=dim, keepdims=keepdim).astype(jnp.int64),
    )


@lowers(aten.min.dim)
def _min_dim(ctx: OpContext, x: Any, dim: int, keepdim: bool = False) -> Any:
    return (
        jnp.min(x, axis=dim, keepdims=keepdim),
        jnp.argmin(x, axis=dim, keepdims=keepdim).astype(jnp.int64),
    )


@lowers(aten.max.default)
def _max_all(ctx: OpContext, x: Any) -> Any:
    return jnp.max(x)


@lowers(aten.min.default)
def _min_all(ctx: OpContext, x: Any) -> Any:
    return jnp.min(x)


@lowers(aten.argmax.default)
def _argmax(ctx: OpContext, x: Any, dim: int | None = None, keepdim: bool = False) -> Any:
    if dim is None:
        out = jnp.argmax(x.reshape(-1))
        return out.reshape((1,) * x.ndim) if keepdim else out
    return jnp.argmax(x, axis=dim, keepdims=keepdim)


@lowers(aten.argmin.default)
def _argmin(ctx: OpContext, x: Any, dim: int | None = None, keepdim: bool = False) -> Any:
    if dim is None:
        out = jnp.argmin(x.reshape(-1))
        return out.reshape((1,) * x.ndim) if keepdim else out
    return jnp.argmin(x, axis=dim, keepdims=keepdim)


@lowers(aten.any.dim, aten.any.dims, aten.any.default)
def _any(ctx: OpContext, x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    return jnp.any(_c(x, torch.bool), axis=_axes(x, dim), keepdims=keepdim)


@lowers(aten.all.dim, aten.all.dims, aten.all.default)
def _all(ctx: OpContext, x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    return jnp.all(_c(x, torch.bool), axis=_axes(x, dim), keepdims=keepdim)


def _var_parts(ctx: OpContext, x: Any, dim: Any, correction: Any, keepdim: bool) -> tuple[Any, Any]:
    dt = compute_dtype(ctx.out_at(0).dtype)
    x = _c(x, dt)
    axes = _axes(x, dim)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    n = 1
    for a in axes:
        n *= x.shape[a]
    c = 1 if correction is None else correction
    # Two passes (mean, then squared deviations), as torch's kernels: no cancellation.
    var = jnp.sum(jnp.square(x - mean), axis=axes, keepdims=keepdim) / max(n - c, 0)
    return var, mean if keepdim else jnp.squeeze(mean, axis=axes)


@lowers(aten.var_mean.correction)
def _var_mean(
    ctx: OpContext, x: Any, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> Any:
    return _var_parts(ctx, x, dim, correction, keepdim)


@lowers(aten.var.correction)
def _var(
    ctx: OpContext, x: Any, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> Any:
    return _var_parts(OpContext((ctx.out,), ctx.key_source), x, dim, correction, keepdim)[0]


@lowers(aten.std.correction)
def _std(
    ctx: OpContext, x: Any, dim: Any = None, *, correction: Any = None, keepdim: bool = False
) -> Any:
    parts = _var_parts(OpContext((ctx.out,), ctx.key_source), x, dim, correction, keepdim)
    return jnp.sqrt(parts[0])


@lowers(aten.cumsum.default)
def _cumsum(ctx: OpContext, x: Any, dim: int, *, dtype: Any = None) -> Any:
    (x,) = _arith(ctx, x)
    return jnp.cumsum(x, axis=dim)


@lowers(aten._softmax.default)
def _softmax(ctx: OpContext, x: Any, dim: int, half_to_float: bool) -> Any:
    (x,) = _arith(ctx, x)
    return jax.nn.softmax(x, axis=dim)


@lowers(aten._log_softmax.default)
def _log_softmax(ctx: OpContext, x: Any, dim: int, half_to_float: bool) -> Any:
    (x,) = _arith(ctx, x)
    # jax.nn.log_softmax's arithmetic, written in the program rather than called
    # (jax.nn.log_softmax is a jitted function: a call of a private function in the
    # program), so that the runtime's one-hot rewrite follows nll_loss's pick of the
    # target back to the logits and reads one logit per row (stablehlo/onehot.py).
    shifted = x - lax.stop_gradient(jnp.max(x, dim, initial=-jnp.inf, keepdims=True))
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), dim, keepdims=True))
