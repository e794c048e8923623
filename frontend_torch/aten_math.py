"""Lowerings of aten's elementwise, reduction and matrix operators.

Dtypes follow torch, not jax: every lowering computes in the dtype torch's kernel uses
for the node's result (``compute_dtype``: float32 for half types) and the interpreter
casts the result to the dtype torch computed for the node. Comparisons compute in the
inputs' promoted dtype (``torch.result_type``), as torch does. Matrix products use
jax's highest precision (no TF32 on GPUs, as torch's default) and accumulate half
types in float32.

Imports: torch, jax, numpy, this package's registry.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .registry import OpContext, compute_dtype, is_array, lowers, select, to_dtype
from .remat import optimization_barrier

aten = torch.ops.aten

_TORCH_OF_JAX = {
    np.dtype(jnp.float64): torch.float64,
    np.dtype(jnp.float32): torch.float32,
    np.dtype(jnp.bfloat16): torch.bfloat16,
    np.dtype(jnp.float16): torch.float16,
    np.dtype(jnp.int64): torch.int64,
    np.dtype(jnp.int32): torch.int32,
    np.dtype(jnp.int16): torch.int16,
    np.dtype(jnp.int8): torch.int8,
    np.dtype(jnp.uint64): torch.uint64,
    np.dtype(jnp.uint32): torch.uint32,
    np.dtype(jnp.uint16): torch.uint16,
    np.dtype(jnp.uint8): torch.uint8,
    np.dtype(jnp.bool_): torch.bool,
}

HIGHEST = lax.Precision.HIGHEST


def torch_dtype_of(x: Any) -> torch.dtype:
    """The torch dtype of a jax array."""
    return _TORCH_OF_JAX[np.dtype(x.dtype)]


def _meta(x: Any) -> Any:
    """What ``torch.result_type`` needs to know of an argument: a meta tensor or the number."""
    if is_array(x):
        return torch.empty(tuple(x.shape), dtype=torch_dtype_of(x), device="meta")
    return x


def result_type(a: Any, b: Any) -> torch.dtype:
    """torch's promoted dtype of two tensors or Python numbers (0-d tensors count as weak)."""
    out: torch.dtype = torch.result_type(_meta(a), _meta(b))
    return out


def _is(x: Any, value: float) -> bool:
    """Whether a scalar argument is the Python number ``value`` (not a traced 0-d array)."""
    return isinstance(x, (int, float)) and x == value


def _c(x: Any, dtype: torch.dtype) -> Any:
    """An argument in ``dtype``'s jax dtype (arrays cast, numbers made constants)."""
    return to_dtype(x, dtype)


def _arith(ctx: OpContext, *xs: Any) -> list[Any]:
    """The arguments of an arithmetic operator, cast to the dtype its result is computed in."""
    dt = compute_dtype(ctx.out_dtype)
    return [_c(x, dt) for x in xs]


# ------------------------------------------------------------------ arithmetic


@lowers(aten.add.Tensor, aten.add.Scalar)
def _add(ctx: OpContext, a: Any, b: Any, *, alpha: Any = 1) -> Any:
    a, b = _arith(ctx, a, b)
    return a + b if _is(alpha, 1) else a + _c(alpha, compute_dtype(ctx.out_dtype)) * b


@lowers(aten.sub.Tensor, aten.sub.Scalar)
def _sub(ctx: OpContext, a: Any, b: Any, *, alpha: Any = 1) -> Any:
    a, b = _arith(ctx, a, b)
    return a - b if _is(alpha, 1) else a - _c(alpha, compute_dtype(ctx.out_dtype)) * b


@lowers(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(ctx: OpContext, a: Any, b: Any, *, alpha: Any = 1) -> Any:
    return _sub(ctx, b, a, alpha=alpha)


@lowers(aten.mul.Tensor, aten.mul.Scalar)
def _mul(ctx: OpContext, a: Any, b: Any) -> Any:
    if ctx.out_dtype == torch.bool:
        return jnp.logical_and(_c(a, torch.bool), _c(b, torch.bool))
    a, b = _arith(ctx, a, b)
    return a * b


@lowers(aten.div.Tensor, aten.div.Scalar)
def _div(ctx: OpContext, a: Any, b: Any) -> Any:
    a, b = _arith(ctx, a, b)
    return a / b


@lowers(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(ctx: OpContext, a: Any, b: Any, *, rounding_mode: str | None = None) -> Any:
    if rounding_mode is None:
        return _div(ctx, a, b)
    a, b = _arith(ctx, a, b)
    if jnp.issubdtype(a.dtype, jnp.integer):
        if rounding_mode == "floor":
            return jnp.floor_divide(a, b)
        # Integer division truncating towards zero (C semantics).
        q = jnp.floor_divide(a, b)
        return jnp.where((q < 0) & (q * b != a), q + 1, q)
    q = a / b
    return jnp.floor(q) if rounding_mode == "floor" else jnp.trunc(q)


@lowers(aten.remainder.Tensor, aten.remainder.Scalar)
def _remainder(ctx: OpContext, a: Any, b: Any) -> Any:
    a, b = _arith(ctx, a, b)
    return jnp.remainder(a, b)  # the sign of the divisor, as torch.remainder


@lowers(aten.fmod.Tensor, aten.fmod.Scalar)
def _fmod(ctx: OpContext, a: Any, b: Any) -> Any:
    a, b = _arith(ctx, a, b)
    return jnp.fmod(a, b)


def _pow_scalar_exponent(x: Any, e: Any) -> Any:
    """``x ** e`` for a Python exponent, with the special cases torch's kernel has."""
    if isinstance(e, (int, float)) and not isinstance(e, bool):
        if e == 2:
            return x * x
        if e == 3:
            return x * x * x
        if e == 0.5:
            return jnp.sqrt(x)
        if e == -0.5:
            return lax.rsqrt(x)
        if e == -1:
            return 1 / x
        if e == -2:
            return 1 / (x * x)
        if float(e).is_integer() and jnp.issubdtype(x.dtype, jnp.integer):
            return lax.integer_pow(x, int(e))
    return jnp.power(x, _c(e, torch_dtype_of(x)))


@lowers(aten.pow.Tensor_Scalar)
def _pow_ts(ctx: OpContext, x: Any, e: Any) -> Any:
    (x,) = _arith(ctx, x)
    return _pow_scalar_exponent(x, e)


@lowers(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(ctx: OpContext, a: Any, b: Any) -> Any:
    a, b = _arith(ctx, a, b)
    return jnp.power(a, b)


@lowers(aten.maximum.default)
def _maximum(ctx: OpContext, a: Any, b: Any) -> Any:
    a, b = _arith(ctx, a, b)
    return jnp.maximum(a, b)


@lowers(aten.minimum.default)
def _minimum(ctx: OpContext, a: Any, b: Any) -> Any:
    a, b = _arith(ctx, a, b)
    return jnp.minimum(a, b)


@lowers(aten.atan2.default)
def _atan2(ctx: OpContext, a: Any, b: Any) -> Any:
    a, b = _arith(ctx, a, b)
    return jnp.arctan2(a, b)


@lowers(aten.clamp.default, aten.clamp.Tensor)
def _clamp(ctx: OpContext, x: Any, min: Any = None, max: Any = None) -> Any:
    dt = compute_dtype(ctx.out_dtype)
    x = _c(x, dt)
    if min is not None:
        x = jnp.maximum(x, _c(min, dt))
    if max is not None:
        x = jnp.minimum(x, _c(max, dt))
    return x


@lowers(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(ctx: OpContext, cond: Any, a: Any, b: Any) -> Any:
    dt = ctx.out_dtype
    return select(_c(cond, torch.bool), _c(a, dt), _c(b, dt))


def _unary(fn: Any, *ops: Any) -> None:
    def lower(ctx: OpContext, x: Any) -> Any:
        (x,) = _arith(ctx, x)
        return fn(x)

    lowers(*ops)(lower)


_unary(jnp.negative, aten.neg.default)
_unary(jnp.abs, aten.abs.default)
_unary(jnp.exp, aten.exp.default)
_unary(jnp.exp2, aten.exp2.default)
_unary(jnp.expm1, aten.expm1.default)
_unary(jnp.log, aten.log.default)
_unary(jnp.log1p, aten.log1p.default)
_unary(jnp.log2, aten.log2.default)
_unary(jnp.log10, aten.log10.default)
_unary(jnp.sqrt, aten.sqrt.default)
_unary(lax.rsqrt, aten.rsqrt.default)
_unary(lambda x: 1 / x, aten.reciprocal.default)
_unary(jnp.tanh, aten.tanh.default)
_unary(jax.nn.sigmoid, aten.sigmoid.default)
_unary(jnp.sin, aten.sin.default)
_unary(jnp.cos, aten.cos.default)
_unary(jnp.tan, aten.tan.default)
_unary(jnp.arcsin, aten.asin.default)
_unary(jnp.arccos, aten.acos.default)
_unary(jnp.arctan, aten.atan.default)
_unary(jnp.sinh, aten.sinh.default)
_unary(jnp.cosh, aten.cosh.default)
_unary(jnp.arcsinh, aten.asinh.default)
_unary(jnp.arccosh, aten.acosh.default)
_unary(jnp.arctanh, aten.atanh.default)
_unary(jax.scipy.special.erf, aten.erf.default)
_unary(jax.scipy.special.erfinv, aten.erfinv.default)
_unary(jnp.sign, aten.sign.default)
_unary(jnp.floor, aten.floor.default)
_unary(jnp.ceil, aten.ceil.default)
_unary(jnp.round, aten.round.default)  # half to even, as torch.round
_unary(jnp.trunc, aten.trunc.default)
_unary(lambda x: jnp.maximum(x, jnp.zeros((), x.dtype)), aten.relu.default)


@lowers(aten.gelu.default)
def _gelu(ctx: OpContext, x: Any, *, approximate: str = "none") -> Any:
    (x,) = _arith(ctx, x)
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1 + jnp.tanh(inner))
    return x * 0.5 * (1 + jax.scipy.special.erf(x * (1 / math.sqrt(2))))


# ------------------------------------------------------------ comparisons, logic


def _compare(fn: Any, *ops: Any) -> None:
    def lower(ctx: OpContext, a: Any, b: Any) -> Any:
        dt = result_type(a, b)
        return fn(_c(a, dt), _c(b, dt))

    lowers(*ops)(lower)


_compare(jnp.equal, aten.eq.Tensor, aten.eq.Scalar)
_compare(jnp.not_equal, aten.ne.Tensor, aten.ne.Scalar)
_compare(jnp.less, aten.lt.Tensor, aten.lt.Scalar)
_compare(jnp.less_equal, aten.le.Tensor, aten.le.Scalar)
_compare(jnp.greater, aten.gt.Tensor, aten.gt.Scalar)
_compare(jnp.greater_equal, aten.ge.Tensor, aten.ge.Scalar)


def _bitwise(fn: Any, *ops: Any) -> None:
    def lower(ctx: OpContext, a: Any, b: Any) -> Any:
        dt = ctx.out_dtype
        return fn(_c(a, dt), _c(b, dt))

    lowers(*ops)(lower)


_bitwise(jnp.bitwise_and, aten.bitwise_and.Tensor, aten.bitwise_and.Scalar)
_bitwise(jnp.bitwise_or, aten.bitwise_or.Tensor, aten.bitwise_or.Scalar)
_bitwise(jnp.bitwise_xor, aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar)


@lowers(aten.bitwise_not.default)
def _bitwise_not(ctx: OpContext, x: Any) -> Any:
    return jnp.invert(x)


def _logical(fn: Any, *ops: Any) -> None:
    def lower(ctx: OpContext, a: Any, b: Any) -> Any:
        return fn(_c(a, torch.bool), _c(b, torch.bool))

    lowers(*ops)(lower)


_logical(jnp.logical_and, aten.logical_and.default)
_logical(jnp.logical_or, aten.logical_or.default)
_logical(jnp.logical_xor, aten.logical_xor.default)


@lowers(aten.logical_not.default)
def _logical_not(ctx: OpContext, x: Any) -> Any:
    return jnp.logical_not(_c(x, torch.bool))


@lowers(aten.isnan.default)
def _isnan(ctx: OpContext, x: Any) -> Any:
    return jnp.isnan(x)


@lowers(aten.isinf.default)
def _isinf(ctx: OpContext, x: Any) -> Any:
    return jnp.isinf(x)


# ---------------------------------------------------------------------- matrices


def _dot(ctx: OpContext, a: Any, b: Any, dims: Any) -> Any:
    """A dot_general in torch's precision: exact float32, half types accumulated in float32.
    Every operator lowered through it is in ``export._PRODUCTS`` (the recorded precision)."""
    dt = ctx.out_dtype
    a, b = _c(a, dt), _c(b, dt)
    preferred = jnp.float32 if dt in (torch.float16, torch.bfloat16) else None
    if all(a.shape[d] == 1 for d in dims[0][0]):
        # An outer product (rotary embeddings' inv_freq @ positions): one multiplication
        # per element and no sum, so the product itself, which no matmul precision can
        # round (a TPU's bf16 passes would round a float32 dot's operands).
        wide = preferred or a.dtype
        return a.astype(wide) * b.astype(wide)
    return lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=preferred)


@lowers(aten.mm.default)
def _mm(ctx: OpContext, a: Any, b: Any) -> Any:
    return _dot(ctx, a, b, (((1,), (0,)), ((), ())))


@lowers(aten.bmm.default)
def _bmm(ctx: OpContext, a: Any, b: Any) -> Any:
    return _dot(ctx, a, b, (((2,), (1,)), ((0,), (0,))))


@lowers(aten.addmm.default)
def _addmm(ctx: OpContext, bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Any:
    prod = _dot(ctx, a, b, (((1,), (0,)), ((), ())))
    dt = compute_dtype(ctx.out_dtype)
    prod = _c(prod, dt)
    if not _is(alpha, 1):
        prod = prod * _c(alpha, dt)
    bias = _c(bias, dt)
    if _is(beta, 0):
        return prod
    return prod + (bias if _is(beta, 1) else bias * _c(beta, dt))


# ------------------------------------------------ Python arithmetic on scalars

# Graphs can do arithmetic on numbers torch read from tensors (``.item()``, which the
# capture keeps as 0-d arrays): ``operator`` calls on them.
for _op in (operator.add, operator.sub, operator.mul, operator.truediv, operator.pow):
    lowers(_op)(lambda ctx, a, b, _f=_op: _f(a, b))
lowers(operator.neg)(lambda ctx, a: -a)
lowers(operator.getitem)(lambda ctx, a, i: a[i])


# ------------------------------------------------ activation checkpointing (remat.py)


@lowers(optimization_barrier._opoverload)
def _optimization_barrier(ctx: OpContext, xs: list[Any]) -> list[Any]:
    return list(lax.optimization_barrier(list(xs)))  # type: ignore[no-untyped-call]
