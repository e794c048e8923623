"""Every ``torch.optim`` optimizer, from a fresh state, as one replayable graph.

Three things make an optimizer's step traceable by torch_xla as the same graph on every
call, from the very first one:

* **The first step's state exists before the first trace.** A fresh optimizer creates its
  state lazily inside its first ``step()``; ``fresh_state`` creates the same tensors (same
  keys, order, shapes, dtypes, values) up front, on the device, as each optimizer's
  ``_init_group`` (torch 2.9) would. A steady-state step from them is the first step.
* **Step counts stay tensors.** ``traced_optimizer`` makes ``torch.compiler.is_compiling()``
  true while (and only while) ``optimizer.step()`` runs, the way ``torch.export`` does:
  ``torch.optim`` then keeps its step counts as tensors (``_get_value``) instead of reading
  them with ``.item()``, and skips the capturable device check whose supported devices
  lack ``xla``. The model's forward and backward do not see the flag.
* **What still reads the host is replaced or refused.** Adagrad's single-tensor update
  passes its step-dependent lr to ``addcdiv_(value=...)`` (a Python number): its traced
  step takes torch's own foreach implementation, which keeps it a tensor. Adafactor reads
  two norms with ``.item()`` every step: its traced step is the same update written with
  tensor ops (``_adafactor_step``). Settings whose update branches on the step count in
  Python (non-capturable Adamax, NAdam, RAdam, ASGD, Rprop) are traced with
  ``capturable=True``, the same update with the step count on the device
  (``stepbundle.frontend.fresh_state.take_capturable``, both front-ends).

Imports: torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from stepbundle.frontend.errors import ExportError
from stepbundle.frontend.fresh_state import NEEDS_CAPTURABLE, fresh_state

__all__ = ["NEEDS_CAPTURABLE", "check_optimizer", "fresh_state", "traced_optimizer"]


def check_optimizer(opt: torch.optim.Optimizer) -> None:
    """Refuse, before tracing, optimizer settings no bundle can replay; the message says
    the exact fix."""
    name = type(opt).__name__
    for i, g in enumerate(opt.param_groups):
        where = f"{name} (param_groups[{i}])"
        if g.get("differentiable", False):
            raise ExportError(
                f"{where} was built with differentiable=True, which keeps autograd history "
                "through the update; a bundle's step has none. Build it with "
                "differentiable=False."
            )
        if g.get("fused", False):
            raise ExportError(
                f"{where} was built with fused=True, a CUDA/CPU kernel torch_xla does not "
                "have. Build it with fused=False (and capturable=True where it has one)."
            )


def _foreach_for(opt: torch.optim.Optimizer) -> bool | None:
    """The ``foreach`` the traced step uses: None keeps the user's."""
    if isinstance(opt, torch.optim.Adagrad):
        return True  # its single-tensor update reads the step-dependent lr as a number
    if isinstance(opt, torch.optim.Adafactor):
        return False  # _adafactor_step replaces the single-tensor update
    return None


@contextlib.contextmanager
def traced_optimizer(opt: torch.optim.Optimizer) -> Iterator[None]:
    """Within it, ``opt.step()`` runs as it would under ``torch.compile`` (step counts
    stay tensors), with the replacements described in the module docstring."""
    import torch.compiler as tc
    import torch.optim._adafactor as adafactor_module

    saved_flag = tc._is_compiling_flag
    saved_foreach = [g.get("foreach") for g in opt.param_groups]
    foreach = _foreach_for(opt)

    def pre(*_: Any) -> None:
        tc._is_compiling_flag = True

    def post(*_: Any) -> None:
        tc._is_compiling_flag = saved_flag

    handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    saved_single = adafactor_module._single_tensor_adafactor
    try:
        if foreach is not None:
            for g in opt.param_groups:
                g["foreach"] = foreach
        adafactor_module._single_tensor_adafactor = _adafactor_step
        yield
    finally:
        adafactor_module._single_tensor_adafactor = saved_single
        tc._is_compiling_flag = saved_flag
        for h in handles:
            h.remove()
        if foreach is not None:
            for g, f in zip(opt.param_groups, saved_foreach):
                g["foreach"] = f


def _adafactor_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    row_vars: list[torch.Tensor | None],
    col_vars: list[torch.Tensor | None],
    variances: list[torch.Tensor | None],
    state_steps: list[torch.Tensor],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    *,
    d: float,
    lr: torch.Tensor | float,
    beta2_decay: float,
    weight_decay: float,
    eps1: float | None,
    eps2: float,
    maximize: bool,
    has_complex: bool,
) -> None:
    """torch 2.9's ``_single_tensor_adafactor`` with tensor ops where it reads the host
    (``step.item()``, ``norm().item()``, Python ``min``/``max``): the same update."""
    if grad_scale is not None or found_inf is not None:
        raise ExportError("Adafactor: grad scaling must happen outside optimizer.step().")
    lr_value = float(lr.detach().cpu()) if isinstance(lr, torch.Tensor) else float(lr)
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        step_t = state_steps[i]
        row_var, col_var, variance = row_vars[i], col_vars[i], variances[i]
        e1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
        step_t += 1
        one_minus_beta2_t = step_t**beta2_decay
        rho_t = torch.clamp(step_t.rsqrt(), max=lr_value)
        alpha = torch.clamp(param.norm(2) / (param.numel() ** 0.5), min=eps2) * rho_t
        if weight_decay != 0:
            param.mul_(1 - lr_value * weight_decay)
        if grad.dim() > 1:
            assert row_var is not None and col_var is not None
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t.to(row_var.dtype))
            col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t.to(col_var.dtype))
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=e1))
        else:
            assert variance is not None
            variance.lerp_(grad * grad, one_minus_beta2_t.to(variance.dtype))
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=e1 * e1).rsqrt_()
        update.mul_(grad)
        denom = torch.clamp(update.norm(2) / ((update.numel() ** 0.5) * d), min=1.0)
        param.add_(update * (-alpha / denom).to(param.dtype))
