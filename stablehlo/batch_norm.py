"""Training BatchNorm in plain StableHLO ops, computed the way PyTorch computes it.

``stablehlo.batch_norm_training`` and ``stablehlo.batch_norm_grad`` say *what* to
compute, not how; every XLA release expands them itself, and XLA expands the variance as
E[x^2] - E[x]^2. That difference cancels when a channel's mean is large against its
spread: with inputs of mean 30 and std 1 the output is off by ~1e-4 (PyTorch's kernels:
~1e-6), the error grows through a deep network, and it changes with the XLA version a
bundle runs on. ``decompose_batch_norm`` replaces both ops, in place, by the two-pass
form PyTorch's kernels use:

* forward: ``mean = sum(x) / N``; ``xc = x - mean``; ``var = sum(xc * xc) / N`` (biased,
  as the op defines it); ``y = (xc * rsqrt(var + eps)) * scale + offset``;
* backward, from centred values: ``xhat = (x - mean) * rsqrt(var + eps)``;
  ``grad_offset = sum(dy)``; ``grad_scale = sum(dy * xhat)``;
  ``grad_x = scale * rsqrt(var + eps) * (dy - grad_offset / N - xhat * grad_scale / N)``.

The batch variance ``batch_norm_training`` returns is the biased one, and torch_xla feeds
that same value to two places: the normalisation (``rsqrt(var + eps)``, and through it
``batch_norm_grad``), which needs it biased, and the running-variance update
(``var * momentum + running_var * (1 - momentum)``), where PyTorch uses the unbiased
variance, ``var * N / (N - 1)``. So the variance's uses that are that update (a
``multiply`` of the variance itself) get the unbiased value; every other use (the normalisation,
a variance the program returns) keeps the op's biased one. layer_norm and group_norm,
which torch_xla also lowers to ``batch_norm_training``, keep no running statistics, so
nothing of theirs changes.

Sums run over every dimension but the feature dimension. Half-precision operands
(bf16, f16) are computed in float32 and the results converted back, as PyTorch's
kernels accumulate them in float32. ``batch_norm_inference`` is left alone: it uses the
running statistics it is given and computes no variance.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.artifact.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from .artifact import Module, ProgramError

# jaxlib's stubs do not cover the StableHLO dialect's op builders.
hlo: Any = _stablehlo

__all__ = ["BATCH_NORM_TRAINING_OPS", "decompose_batch_norm"]

BATCH_NORM_TRAINING_OPS: frozenset[str] = frozenset(
    {"stablehlo.batch_norm_training", "stablehlo.batch_norm_grad"}
)
"""The ops ``decompose_batch_norm`` replaces."""


class _Build:
    """Builds the replacement of one op, before it, in its compute element type."""

    def __init__(self, op: Any, operand: Any) -> None:
        self.op = op
        t = ir.RankedTensorType(operand.type)
        self.shape = [int(d) for d in t.shape]
        self.element = t.element_type
        # Compared by name: jaxlib 0.7 has ``BF16Type.isinstance``, newer releases
        # Python's isinstance on downcast types.
        half = str(self.element) in ("bf16", "f16")
        self.compute = ir.F32Type.get() if half else self.element
        self.feature = ir.IntegerAttr(op.attributes["feature_index"]).value
        self.epsilon = ir.FloatAttr(op.attributes["epsilon"]).value
        self.channels = self.shape[self.feature]
        self.dims = [d for d in range(len(self.shape)) if d != self.feature]
        n = 1
        for d in self.dims:
            n *= self.shape[d]
        self.count = n

    def tensor(self, shape: list[int]) -> Any:
        return ir.RankedTensorType.get(shape, self.compute)

    def cast(self, value: Any) -> Any:
        """``value`` in the compute type (a no-op for float32 and float64)."""
        t = ir.RankedTensorType(value.type)
        if t.element_type == self.compute:
            return value
        return hlo.ConvertOp(ir.RankedTensorType.get(list(t.shape), self.compute), value).result

    def back(self, value: Any) -> Any:
        """``value`` in the operand's element type."""
        if self.compute == self.element:
            return value
        t = ir.RankedTensorType(value.type)
        return hlo.ConvertOp(ir.RankedTensorType.get(list(t.shape), self.element), value).result

    def constant(self, value: float, shape: list[int]) -> Any:
        attr = ir.DenseElementsAttr.get_splat(
            self.tensor(shape), ir.FloatAttr.get(self.compute, value)
        )
        return hlo.ConstantOp(attr).result

    def per_channel(self, value: Any) -> Any:
        """A [C] value broadcast along the feature dimension of the operand's shape."""
        return hlo.BroadcastInDimOp(
            self.tensor(self.shape), value, ir.DenseI64ArrayAttr.get([self.feature])
        ).result

    def channel_sum(self, value: Any) -> Any:
        """The sum over every dimension but the feature dimension: a [C] value."""
        scalar = self.tensor([])
        red = hlo.ReduceOp(
            [self.tensor([self.channels])],
            [value],
            [self.constant(0.0, [])],
            ir.DenseI64ArrayAttr.get(self.dims),
        )
        block = red.regions[0].blocks.append(scalar, scalar)
        with ir.InsertionPoint(block):
            hlo.ReturnOp([hlo.AddOp(block.arguments[0], block.arguments[1]).result])
        return red.results[0]

    def channel_mean(self, value: Any) -> Any:
        return hlo.DivOp(
            self.channel_sum(value), self.constant(float(self.count), [self.channels])
        ).result

    def inv_std(self, var: Any) -> Any:
        eps = self.constant(self.epsilon, [self.channels])
        return hlo.RsqrtOp(hlo.AddOp(var, eps).result).result


def _updates_running_var(use: Any) -> bool:
    """Whether a use of the batch variance is torch_xla's running-variance update,
    ``LinearInterpolation``: ``var * factor + running_var * (1 - factor)``, with ``factor``
    ``momentum`` or, for ``momentum=None``, a value the graph computes. torch_xla folds a
    factor of 1 away, leaving ``add(var, running_var * 0)``; the only other use of the
    variance is the normalisation's ``add(var, eps)``, eps a constant. So: a multiply, or
    an add of anything but a constant."""
    owner = use.owner
    if owner.name == "stablehlo.multiply":
        return True
    if owner.name != "stablehlo.add":
        return False
    other = owner.operands[1 - use.operand_number].owner
    # A block argument's owner is a Block, which has no name: not a constant either.
    return getattr(other, "name", None) not in ("stablehlo.constant", "stablehlo.broadcast_in_dim")


def _training(op: Any) -> list[Any]:
    """(output, batch_mean, batch_var) of ``batch_norm_training(x, scale, offset)``;
    ``_unbiased`` rewires the running-variance update."""
    x_in, scale_in, offset_in = op.operands
    b = _Build(op, x_in)
    x, scale, offset = b.cast(x_in), b.cast(scale_in), b.cast(offset_in)
    mean = b.channel_mean(x)
    xc = hlo.SubtractOp(x, b.per_channel(mean)).result
    var = b.channel_mean(hlo.MulOp(xc, xc).result)
    # ((x - mean) * rsqrt(var + eps)) * scale + offset, in this order, as torch's own
    # decomposition of native_batch_norm writes it. Folding scale into rsqrt first
    # (x - mean) * (rsqrt(var + eps) * scale) rounds differently, and on jax 0.10.2's XLA
    # that put resnet18's conv1 gradient 1.6e-3 (normwise) off float64 after 3 steps
    # (the order here: 1.1e-5; why that XLA is so sensitive to it is not understood).
    xhat = hlo.MulOp(xc, b.per_channel(b.inv_std(var))).result
    y = hlo.AddOp(hlo.MulOp(xhat, b.per_channel(scale)).result, b.per_channel(offset)).result
    return [b.back(y), b.back(mean), b.back(var)]


def _unbiased(op: Any, var: Any) -> None:
    """Point the running-variance update among the uses of ``op``'s variance at
    ``var * N / (N - 1)``, as PyTorch updates it; built before ``op``."""
    b = _Build(op, op.operands[0])
    others = [u for u in op.results[2].uses if _updates_running_var(u)]
    if not others or b.count < 2:  # N == 1: PyTorch refuses such a batch in training
        return
    with ir.InsertionPoint(op), op.location:
        factor = b.constant(b.count / (b.count - 1), [b.channels])
        unbiased = b.back(hlo.MulOp(b.cast(var), factor).result)
    for u in others:
        u.owner.operands[u.operand_number] = unbiased


def _grad(op: Any) -> list[Any]:
    """(grad_operand, grad_scale, grad_offset) of ``batch_norm_grad(x, scale, mean, var, dy)``."""
    x_in, scale_in, mean_in, var_in, dy_in = op.operands
    b = _Build(op, x_in)
    x, scale, mean, var, dy = (b.cast(v) for v in (x_in, scale_in, mean_in, var_in, dy_in))
    inv = b.inv_std(var)
    xhat = hlo.MulOp(hlo.SubtractOp(x, b.per_channel(mean)).result, b.per_channel(inv)).result
    grad_offset = b.channel_sum(dy)
    grad_scale = b.channel_sum(hlo.MulOp(dy, xhat).result)
    n = b.constant(float(b.count), [b.channels])
    mean_dy = hlo.DivOp(grad_offset, n).result
    mean_dy_xhat = hlo.DivOp(grad_scale, n).result
    inner = hlo.SubtractOp(
        hlo.SubtractOp(dy, b.per_channel(mean_dy)).result,
        hlo.MulOp(xhat, b.per_channel(mean_dy_xhat)).result,
    ).result
    grad_x = hlo.MulOp(inner, b.per_channel(hlo.MulOp(scale, inv).result)).result
    return [b.back(grad_x), b.back(grad_scale), b.back(grad_offset)]


def decompose_batch_norm(module: Module) -> int:
    """Replace every ``batch_norm_training`` and ``batch_norm_grad`` in ``module``.

    Every function and nested region is rewritten in place; the module is verified
    afterwards. Returns the number of ops replaced (0 leaves the module as it was).

    Raises:
      ValueError: an op has a dynamic shape, or the rewritten module does not verify.
    """
    ctx = module._ctx
    targets = [op for op in module._operations() if op.name in BATCH_NORM_TRAINING_OPS]
    with ctx:
        for op in targets:
            t = ir.RankedTensorType(op.operands[0].type)
            if any(ir.ShapedType.is_dynamic_size(d) for d in t.shape):
                raise ProgramError(
                    f"{op.name} has an operand of dynamic shape {t}; only static shapes "
                    "can be decomposed"
                )
            with ir.InsertionPoint(op), op.location:
                new = _training(op) if op.name == "stablehlo.batch_norm_training" else _grad(op)
            if op.name == "stablehlo.batch_norm_training":
                _unbiased(op, new[2])
            for old, value in zip(op.results, new):
                old.replace_all_uses_with(value)
            op.erase()
        if targets and not module._module.operation.verify():
            raise ProgramError("the module does not verify after decomposing its BatchNorm ops")
    return len(targets)
