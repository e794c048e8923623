"""Module modes inside a traced training step: BatchNorm in eval mode that still trains.

A training step may keep some modules in eval mode (a frozen BatchNorm during
fine-tuning). torch_xla 2.9 cannot differentiate BatchNorm in eval mode: its
``native_batch_norm_backward`` reads the batch statistics that eval mode never computes,
and fails with "The size of mean should be compatible with feature count, but the size
of offset factor is 0" (eager torch_xla fails the same way). ``eval_batchnorm()``
computes eval-mode ``F.batch_norm`` from its definition instead, with elementwise ops
torch_xla differentiates: ``(x - running_mean) * rsqrt(running_var + eps) * weight + bias``.
Training-mode BatchNorm is not touched.

Remove when torch_xla's eval-mode BatchNorm backward works (not in 2.9).

Imports: torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["eval_batchnorm"]

_BN_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_BN_DEFAULTS: dict[str, Any] = {
    "weight": None,
    "bias": None,
    "training": False,
    "momentum": 0.1,
    "eps": 1e-5,
}


def call_arguments(
    names: Sequence[str],
    defaults: Mapping[str, Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> dict[str, Any]:
    """A torch function's call seen by a TorchFunctionMode, as one dict by parameter name
    (``names`` in order; ``defaults`` for what the call leaves out)."""
    out = dict(defaults)
    out.update(zip(names, args))
    out.update(kwargs)
    return out


def _eval_batch_norm(a: Mapping[str, Any]) -> torch.Tensor:
    x: torch.Tensor = a["input"]
    shape = [1, -1] + [1] * (x.dim() - 2)
    mean: torch.Tensor = a["running_mean"]
    invstd = torch.rsqrt(a["running_var"] + a["eps"])
    y = (x - mean.reshape(shape)) * invstd.reshape(shape)
    if a["weight"] is not None:
        y = y * a["weight"].reshape(shape)
    if a["bias"] is not None:
        y = y + a["bias"].reshape(shape)
    return y.to(x.dtype)


class eval_batchnorm(TorchFunctionMode):  # noqa: N801 - used as a context manager, like a function
    """Within it, eval-mode ``F.batch_norm`` (running statistics, ``training=False``) is
    computed from its definition, so torch_xla can differentiate it.

    The exporter traces every training step under it. An eager torch_xla loop that keeps
    BatchNorm frozen needs it too: ``with eval_batchnorm(): loss.backward()`` is not
    enough, the forward must run inside it (``with eval_batchnorm(): step(...)``).
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.batch_norm:
            a = call_arguments(_BN_ARGS, _BN_DEFAULTS, args, kwargs)
            if not a["training"] and a["running_mean"] is not None and a["running_var"] is not None:
                return _eval_batch_norm(a)
        return func(*args, **kwargs)
