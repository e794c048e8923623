"""The user's model and optimizer, saved before a front-end swaps its own tensors in.

Both front-ends trace the user's own objects, so that everything the step refers to (a
scheduler built on the optimizer, a closure over the model) sees what the traced step
does; what they swap in differs (device copies for torch_xla, tracer tensors for torch).
``UserObjects`` holds what every module and ``param_groups`` held before, and puts it all
back: the user's model and optimizer are exactly as they were after an export.

Imports: torch.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

__all__ = ["UserObjects"]

_Self = TypeVar("_Self", bound="UserObjects")


class UserObjects:
    """What the user's model and optimizer held, saved to be put back.

    Attributes:
      model, optimizer: the user's objects.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self._modules = list(model.modules())
        self._saved_params = [dict(m._parameters) for m in self._modules]
        self._saved_buffers = [dict(m._buffers) for m in self._modules]
        self._saved_training = [m.training for m in self._modules]
        self._saved_groups: list[dict[str, Any]] = [dict(g) for g in optimizer.param_groups]
        self._saved_state = optimizer.state

    def restore(self) -> None:
        """Put the user's original parameters, buffers, modes and optimizer contents back."""
        for m, ps, bs, tr in zip(
            self._modules, self._saved_params, self._saved_buffers, self._saved_training
        ):
            m._parameters.clear()
            m._parameters.update(ps)
            m._buffers.clear()
            m._buffers.update(bs)
            m.training = tr
        for group, saved in zip(self.optimizer.param_groups, self._saved_groups):
            group.clear()
            group.update(saved)
        self.optimizer.state = self._saved_state

    def user_modes(self) -> None:
        """Put every module back in the mode (train or eval) the user left it in.

        The training step is traced in those modes, as the user's own loop would run it:
        a frozen BatchNorm stays in eval mode (running statistics read, not updated), a
        dropout the user turned off stays off.
        """
        for m, training in zip(self._modules, self._saved_training):
            m.training = training

    def eval_modules(self) -> tuple[str, ...]:
        """The ``named_modules()`` names of the modules now in eval mode, in model order
        (``Entry.eval_modules``)."""
        return tuple(name for name, m in self.model.named_modules() if not m.training)

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
