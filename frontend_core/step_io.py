"""What a recipe's step takes and gives, checked the same way by both front-ends.

``checked_batch``: an example batch is a dict of non-empty string keys to tensors (the
runtime feeds arrays by those names). ``batch_signature``: the batch's names, dtypes and
shapes, as the manifest records a shape bucket. ``checked_metrics``: a step returns a
dict of name -> tensor, and a training step's dict includes ``"loss"``.
``hyperparameter_values``: the scalar settings of ``param_groups``, for messages that
name a setting which changed between two traced steps.

Imports: torch, stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from stepbundle.schema.manifest import NamedSpec

from .dtypes import spec_of
from .errors import ExportError

__all__ = ["batch_signature", "checked_batch", "checked_metrics", "hyperparameter_values"]


def checked_batch(batch: Mapping[str, torch.Tensor], which: str) -> dict[str, torch.Tensor]:
    """``batch`` with every value detached (on its own device), refused unless every key is
    a non-empty string and every value a tensor of a dtype bundles hold."""
    out = {}
    for k, v in batch.items():
        if not isinstance(k, str) or not k:
            raise ExportError(f"The {which} has a key {k!r}; batch keys must be non-empty strings.")
        if not isinstance(v, torch.Tensor):
            raise ExportError(
                f"The {which} maps {k!r} to {type(v).__name__}; every batch value must be a "
                "tensor (the runtime feeds arrays)."
            )
        spec_of(v.dtype, tuple(v.shape), f"Batch input {k!r}")
        out[k] = v.detach()
    return out


def batch_signature(batch: Mapping[str, torch.Tensor]) -> tuple[NamedSpec, ...]:
    """The batch's inputs by name, dtype and shape (a program's ``batch``)."""
    return tuple(
        NamedSpec(k, spec_of(v.dtype, tuple(v.shape), f"Batch input {k!r}"))
        for k, v in batch.items()
    )


def checked_metrics(
    result: Any, what: str, *, need_loss: bool, device_type: str | None = None
) -> dict[str, torch.Tensor]:
    """The step's returned metrics, detached.

    ``device_type``: the device every metric must be on (``"xla"`` for the torch_xla
    front-end, whose graph holds only what was computed on the XLA device); None takes
    any (the torch front-end's tracer tensors).

    Raises:
      ExportError: not a dict of name -> tensor, a metric on another device, or a
        training step without ``"loss"``.
    """
    if not isinstance(result, Mapping):
        raise ExportError(
            f"The {what} returned {type(result).__name__}; it must return a dict of "
            'name -> tensor, for example {"loss": loss}.'
        )
    where = "on the XLA device" if device_type == "xla" else "computed by the step"
    out: dict[str, torch.Tensor] = {}
    for k, v in result.items():
        if not isinstance(k, str) or not k:
            raise ExportError(
                f"The {what} returned a metric key {k!r}; keys must be non-empty strings."
            )
        if not isinstance(v, torch.Tensor):
            raise ExportError(
                f"The {what} returned {k!r} = {v!r} ({type(v).__name__}); metrics must be "
                f"tensors {where}. Return the tensor itself, not .item()."
            )
        if device_type is not None and v.device.type != device_type:
            raise ExportError(
                f"The {what} returned {k!r} on device {v.device}; metrics must be computed "
                f"{where} from the batch and the model."
            )
        out[k] = v.detach()
    if need_loss and "loss" not in out:
        raise ExportError(
            f'The {what} returned the keys {sorted(out)}; a training step must return "loss".'
        )
    return out


def hyperparameter_values(opt: torch.optim.Optimizer) -> tuple[tuple[str, float], ...]:
    """Every real scalar of ``param_groups`` (tuple elements included), by a name such as
    ``param_groups[0]['betas'][0]``; tensors and other values are left out."""
    vals = []
    for i, group in enumerate(opt.param_groups):
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                vals.append((f"param_groups[{i}][{k!r}]", float(v)))
            elif isinstance(v, tuple):
                for j, e in enumerate(v):
                    if isinstance(e, (int, float)) and not isinstance(e, bool):
                        vals.append((f"param_groups[{i}][{k!r}][{j}]", float(e)))
    return tuple(vals)
