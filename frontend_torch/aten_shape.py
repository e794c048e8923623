"""Lowerings of aten's shape, indexing and tensor-creation operators.

The graphs are functional (every view is a ``*_copy`` or a value of its own), so each
operator here returns a new array. Creation operators take their shape and dtype from
the tracer's fake result, which is what torch decided (default dtypes, inferred sizes).
Uninitialised memory (``empty``) is zeros: a program must not depend on it, and zeros
keep the program deterministic.

Imports: torch, jax, numpy, this package's registry.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import OpContext, jax_dtype, lowers, select, to_dtype

aten = torch.ops.aten


def _dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


# ----------------------------------------------------------------- no-op copies


@lowers(
    aten.alias.default,
    aten.alias_copy.default,
    aten.clone.default,
    aten.lift_fresh_copy.default,
    aten.lift_fresh.default,
    aten.detach.default,
    aten.detach_copy.default,
    aten.contiguous.default,
)
def _identity(ctx: OpContext, x: Any, *args: Any, **kwargs: Any) -> Any:
    return x


@lowers(aten._to_copy.default)
def _to_copy(ctx: OpContext, x: Any, **kwargs: Any) -> Any:
    return to_dtype(x, ctx.out_dtype)


@lowers(aten.copy.default)
def _copy(ctx: OpContext, dst: Any, src: Any, non_blocking: bool = False) -> Any:
    """The functional copy: ``src``'s values in ``dst``'s shape and dtype."""
    return jnp.broadcast_to(to_dtype(src, ctx.out_dtype), ctx.out_shape)


# ------------------------------------------------------------------------ views


@lowers(
    aten.view_copy.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
)
def _view(ctx: OpContext, x: Any, size: Any) -> Any:
    return jnp.reshape(x, ctx.out_shape)


@lowers(aten.permute_copy.default, aten.permute.default)
def _permute(ctx: OpContext, x: Any, dims: Any) -> Any:
    return jnp.transpose(x, [_dim(d, x.ndim) for d in dims])


@lowers(aten.t_copy.default, aten.t.default)
def _t(ctx: OpContext, x: Any) -> Any:
    return x.T


@lowers(aten.transpose_copy.int, aten.transpose.int)
def _transpose(ctx: OpContext, x: Any, a: int, b: int) -> Any:
    return jnp.swapaxes(x, _dim(a, x.ndim), _dim(b, x.ndim))


@lowers(aten.expand.default, aten.expand_copy.default)
def _expand(ctx: OpContext, x: Any, size: Any, *, implicit: bool = False) -> Any:
    return jnp.broadcast_to(x, ctx.out_shape)


@lowers(
    aten.squeeze.dims,
    aten.squeeze.dim,
    aten.squeeze.default,
    aten.squeeze_copy.dims,
    aten.squeeze_copy.dim,
    aten.squeeze_copy.default,
    aten.unsqueeze.default,
    aten.unsqueeze_copy.default,
)
def _reshape_to_out(ctx: OpContext, x: Any, *args: Any) -> Any:
    """Operators that only insert or drop dimensions of size 1: the result's shape says all."""
    return jnp.reshape(x, ctx.out_shape)


@lowers(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided(ctx: OpContext, x: Any, size: Any, stride: Any, storage_offset: Any = None) -> Any:
    """A strided view of a tensor whose memory is in row-major order (jax's logical order).

    Only defined here for an input torch lays out contiguously: then its memory is the
    array flattened, and the view picks ``offset + sum(i_k * stride_k)`` from it.
    """
    meta = ctx.args[0] if ctx.args else None
    if not isinstance(meta, torch.Tensor) or not meta.is_contiguous():
        raise NotImplementedError("as_strided of a tensor that is not contiguous in memory")
    index = np.full((), int(storage_offset or 0), np.int64)
    for n, st in zip(size, stride):
        index = index[..., None] + np.arange(int(n), dtype=np.int64) * int(st)
    return jnp.reshape(x, (-1,))[index]


@lowers(aten.cat.default)
def _cat(ctx: OpContext, tensors: Any, dim: int = 0) -> Any:
    dt = ctx.out_dtype
    ndim = len(ctx.out_shape)
    # torch still accepts 1-d empty tensors in a cat of any rank (legacy behaviour).
    parts = [to_dtype(t, dt) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not parts:
        return jnp.zeros(ctx.out_shape, jax_dtype(dt))
    return jnp.concatenate(parts, axis=_dim(dim, ndim))


@lowers(aten.stack.default)
def _stack(ctx: OpContext, tensors: Any, dim: int = 0) -> Any:
    dt = ctx.out_dtype
    return jnp.stack([to_dtype(t, dt) for t in tensors], axis=_dim(dim, len(ctx.out_shape)))


def _slice_index(ndim: int, dim: int, start: Any, end: Any, step: int) -> tuple[Any, ...]:
    # Python's slice clamps out-of-range bounds exactly as torch does.
    return (slice(None),) * _dim(dim, ndim) + (slice(start, end, step),)


@lowers(aten.slice_copy.Tensor, aten.slice.Tensor)
def _slice(
    ctx: OpContext, x: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1
) -> Any:
    return x[_slice_index(x.ndim, dim, start, end, step)]


@lowers(aten.slice_scatter.default)
def _slice_scatter(
    ctx: OpContext,
    x: Any,
    src: Any,
    dim: int = 0,
    start: Any = None,
    end: Any = None,
    step: int = 1,
) -> Any:
    return x.at[_slice_index(x.ndim, dim, start, end, step)].set(src.astype(x.dtype))


@lowers(aten.select_copy.int, aten.select.int)
def _select(ctx: OpContext, x: Any, dim: int, index: int) -> Any:
    d = _dim(dim, x.ndim)
    return jnp.take(x, index % x.shape[d], axis=d)


@lowers(aten.select_scatter.default)
def _select_scatter(ctx: OpContext, x: Any, src: Any, dim: int, index: int) -> Any:
    d = _dim(dim, x.ndim)
    idx = (slice(None),) * d + (index % x.shape[d],)
    return x.at[idx].set(src.astype(x.dtype))


@lowers(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(ctx: OpContext, x: Any, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    # numpy's diagonal, like torch's, puts the diagonal last.
    return jnp.diagonal(x, offset, _dim(dim1, x.ndim), _dim(dim2, x.ndim))


@lowers(aten.diagonal_scatter.default)
def _diagonal_scatter(
    ctx: OpContext, x: Any, src: Any, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> Any:
    """``x`` with the diagonal ``diagonal(x, offset, dim1, dim2)`` replaced by ``src``."""
    d1, d2 = _dim(dim1, x.ndim), _dim(dim2, x.ndim)
    moved = jnp.moveaxis(x, (d1, d2), (-2, -1))
    n = src.shape[-1]
    rows = np.arange(n) + max(-offset, 0)
    cols = np.arange(n) + max(offset, 0)
    moved = moved.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


@lowers(
    aten.split_with_sizes.default,
    aten.split_with_sizes_copy.default,
    aten.split.Tensor,
    aten.split_copy.Tensor,
)
def _split(ctx: OpContext, x: Any, sizes: Any, dim: int = 0) -> Any:
    """Every splitting operator: the tracer's results give each piece's extent."""
    d = _dim(dim, x.ndim)
    out, start = [], 0
    for piece in ctx.out:
        n = int(piece.shape[d])
        out.append(lax.slice_in_dim(x, start, start + n, axis=d))
        start += n
    return tuple(out)


@lowers(aten.unbind.int, aten.unbind_copy.int)
def _unbind(ctx: OpContext, x: Any, dim: int = 0) -> Any:
    d = _dim(dim, x.ndim)
    return tuple(jnp.take(x, i, axis=d) for i in range(x.shape[d]))


@lowers(aten.constant_pad_nd.default)
def _pad(ctx: OpContext, x: Any, pad: Any, value: Any = 0) -> Any:
    cfg = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        cfg[x.ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]), 0)
    return lax.pad(x, jnp.asarray(value, x.dtype), cfg)  # negative pads crop, as torch


@lowers(aten.flip.default)
def _flip(ctx: OpContext, x: Any, dims: Any) -> Any:
    return jnp.flip(x, axis=tuple(_dim(d, x.ndim) for d in dims))


@lowers(aten.roll.default)
def _roll(ctx: OpContext, x: Any, shifts: Any, dims: Any = ()) -> Any:
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), axis=tuple(dims))


@lowers(aten.tril.default)
def _tril(ctx: OpContext, x: Any, diagonal: int = 0) -> Any:
    return jnp.tril(x, diagonal)


@lowers(aten.triu.default)
def _triu(ctx: OpContext, x: Any, diagonal: int = 0) -> Any:
    return jnp.triu(x, diagonal)


# --------------------------------------------------------------------- indexing


def _advanced(indices: Any) -> tuple[Any, ...]:
    return tuple(slice(None) if i is None else i for i in indices)


@lowers(aten.index.Tensor)
def _index(ctx: OpContext, x: Any, indices: Any) -> Any:
    for i in indices:
        if i is not None and i.dtype == jnp.bool_:
            raise NotImplementedError(
                "indexing with a boolean mask (its result's shape depends on the data)"
            )
    # numpy's advanced indexing is torch's, including where the indexed axes go.
    return x[_advanced(indices)]


@lowers(aten.index_put.default, aten._unsafe_index_put.default)
def _index_put(ctx: OpContext, x: Any, indices: Any, values: Any, accumulate: bool = False) -> Any:
    ref = x.at[_advanced(indices)]
    values = values.astype(x.dtype)
    return ref.add(values) if accumulate else ref.set(values)


@lowers(aten.index_select.default)
def _index_select(ctx: OpContext, x: Any, dim: int, index: Any) -> Any:
    return jnp.take(x, index, axis=_dim(dim, x.ndim))


def _grid(index: Any, dim: int) -> tuple[Any, ...]:
    """Full coordinates of every element of ``index``, with ``index`` itself along ``dim``."""
    coords = list(jnp.indices(index.shape, sparse=True))
    coords[dim] = index
    return tuple(coords)


@lowers(aten.gather.default)
def _gather(ctx: OpContext, x: Any, dim: int, index: Any, *, sparse_grad: bool = False) -> Any:
    if x.ndim == 0:
        return x
    d = _dim(dim, x.ndim)
    if _one_per_row(x, index, d) and jnp.issubdtype(x.dtype, jnp.floating):
        # One position per row, as in nll_loss's forward (the log-probability of each
        # target): the sum of the row with every other position made -0.0, from -0.0,
        # the same value bit for bit (adding -0.0 changes nothing, -0.0 and NaN
        # included). A gather made XLA write all of x first, on a TPU a float32
        # (tokens, vocabulary) log-softmax written only to read one value per row
        # (docs/tpu.md, "The torch front-end on a TPU"). As a sum over a one-hot of the
        # targets the runtime evaluates it at the targets (stablehlo/onehot.py, as for
        # torch_xla's cross-entropy), which reads one logit per row; a max over the row
        # (the form before) was one more pass over the logits, which XLA could not
        # merge with the log-sum-exp's (benchmarks/results/frontend_gap-v5e.md).
        # A position outside the row (a target past the classes that is not nll_loss's
        # ignore_index: eager PyTorch raises) gives -inf, so the loss is not finite and
        # stop_on_nonfinite stops the run, rather than a row that adds nothing.
        hit = lax.broadcasted_iota(index.dtype, x.shape, d) == index
        zero = jnp.asarray(-0.0, x.dtype)
        picked = jnp.expand_dims(lax.reduce(select(hit, x, zero), zero, lax.add, (d,)), d)
        inside = (index >= 0) & (index < x.shape[d])
        return select(inside, picked, jnp.full(picked.shape, -jnp.inf, x.dtype))
    # torch allows an index smaller than the input in the other dimensions.
    return x[_grid(index, d)]


def _one_per_row(x: Any, index: Any, d: int) -> bool:
    """Whether ``index`` names one position along ``d`` for every row of ``x`` (its size
    there is 1 and it matches ``x`` in every other dimension)."""
    return index.shape[d] == 1 and all(
        index.shape[i] == x.shape[i] for i in range(x.ndim) if i != d
    )


@lowers(aten.scatter.value, aten.scatter.src)
def _scatter(ctx: OpContext, x: Any, dim: int, index: Any, src: Any) -> Any:
    d = _dim(dim, x.ndim)
    if hasattr(src, "shape") and src.ndim:
        src = src[tuple(slice(0, n) for n in index.shape)]
    if x.ndim and _one_per_row(x, index, d):
        # One position per row, as in nll_loss's backward (a zero (tokens, classes) tensor
        # with -1 at each target): a comparison with the positions along d, the same
        # values as the scatter, which XLA fuses into the tensor's consumers. The scatter
        # wrote the whole tensor instead; on a TPU as a flat array then relaid out
        # (docs/tpu.md, "The torch front-end on a TPU").
        hit = lax.broadcasted_iota(index.dtype, x.shape, d) == index
        return select(hit, jnp.asarray(src, x.dtype), x)
    return x.at[_grid(index, d)].set(jnp.asarray(src, x.dtype))


@lowers(aten.scatter_add.default)
def _scatter_add(ctx: OpContext, x: Any, dim: int, index: Any, src: Any) -> Any:
    d = _dim(dim, x.ndim)
    src = src[tuple(slice(0, n) for n in index.shape)]
    return x.at[_grid(index, d)].add(src.astype(x.dtype))


@lowers(aten.embedding.default)
def _embedding(
    ctx: OpContext,
    weight: Any,
    indices: Any,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Any:
    return jnp.take(weight, indices, axis=0)


# --------------------------------------------------------------------- creation


def _filled(ctx: OpContext, value: Any) -> Any:
    return jnp.full(ctx.out_shape, jnp.asarray(value).astype(jax_dtype(ctx.out_dtype)))


@lowers(aten.full.default)
def _full(ctx: OpContext, size: Any, fill_value: Any, **kwargs: Any) -> Any:
    return _filled(ctx, fill_value)


@lowers(aten.full_like.default)
def _full_like(ctx: OpContext, x: Any, fill_value: Any, **kwargs: Any) -> Any:
    return _filled(ctx, fill_value)


@lowers(aten.scalar_tensor.default)
def _scalar_tensor(ctx: OpContext, value: Any, **kwargs: Any) -> Any:
    return _filled(ctx, value)


@lowers(aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)
def _zeros(ctx: OpContext, *args: Any, **kwargs: Any) -> Any:
    return jnp.zeros(ctx.out_shape, jax_dtype(ctx.out_dtype))


@lowers(aten.ones.default, aten.ones_like.default, aten.new_ones.default)
def _ones(ctx: OpContext, *args: Any, **kwargs: Any) -> Any:
    return jnp.ones(ctx.out_shape, jax_dtype(ctx.out_dtype))


@lowers(
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_permuted.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
)
def _empty(ctx: OpContext, *args: Any, **kwargs: Any) -> Any:
    return jnp.zeros(ctx.out_shape, jax_dtype(ctx.out_dtype))


@lowers(aten.arange.start_step, aten.arange.start, aten.arange.default)
def _arange(ctx: OpContext, *args: Any, **kwargs: Any) -> Any:
    numbers = [a for a in args if isinstance(a, (int, float))]
    start: int | float
    step: int | float
    if len(numbers) == 1:
        start, step = 0, 1
    else:
        start = numbers[0]
        step = numbers[2] if len(numbers) > 2 else 1
    n = ctx.out_shape[0]
    dt = ctx.out_dtype
    if dt.is_floating_point:
        # torch computes start + i * step in double, then rounds to the result dtype.
        values = np.asarray(start, np.float64) + np.arange(n, dtype=np.float64) * step
        return jnp.asarray(values.astype(np.dtype(jax_dtype(dt))))
    return jnp.asarray(np.arange(n, dtype=np.int64) * int(step) + int(start)).astype(jax_dtype(dt))
