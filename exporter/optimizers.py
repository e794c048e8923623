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
  Python (non-capturable Adamax, NAdam, RAdam, ASGD, Rprop) are refused up front by
  ``check_optimizer`` with the fix (``capturable=True``).

Imports: torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from stepbundle.frontend.errors import ExportError

__all__ = ["check_optimizer", "fresh_state", "traced_optimizer"]

_StateRule = Callable[[dict[str, Any], torch.Tensor], dict[str, torch.Tensor]]


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    # torch.optim's _get_scalar_dtype(): float64 when that is the default dtype, else float32.
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    # A buffer of its own (.clone()): torch_xla hands out one shared device buffer for
    # equal scalars, which would make every parameter's ``mu`` one graph input in the
    # first traced step and separate inputs in the next.
    return torch.full((), value, dtype=dtype).to(like.device).clone()


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _lr(group: dict[str, Any]) -> float:
    lr = group["lr"]
    return float(lr.detach().cpu()) if isinstance(lr, torch.Tensor) else float(lr)


def _rmsprop(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    s = {"step": _scalar(0.0, p), "square_avg": _zeros(p)}
    if group["momentum"] > 0:
        s["momentum_buffer"] = _zeros(p)
    if group["centered"]:
        s["grad_avg"] = _zeros(p)
    return s


def _adamax(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"step": _scalar(0.0, p), "exp_avg": _zeros(p), "exp_inf": _zeros(p)}


def _nadam(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "step": _scalar(0.0, p),
        "mu_product": _scalar(1.0, p),
        "exp_avg": _zeros(p),
        "exp_avg_sq": _zeros(p),
    }


def _radam(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"step": _scalar(0.0, p), "exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)}


def _asgd(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "step": _scalar(0.0, p),
        "eta": _scalar(_lr(group), p),
        "mu": _scalar(1.0, p),
        "ax": _zeros(p),
    }


def _rprop(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "step": _scalar(0.0, p),
        "prev": _zeros(p),
        "step_size": torch.full_like(p, _lr(group), memory_format=torch.preserve_format),
    }


def _adadelta(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"step": _scalar(0.0, p), "square_avg": _zeros(p), "acc_delta": _zeros(p)}


def _adafactor(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    s = {"step": _scalar(0.0, p)}
    if p.dim() > 1:
        row, col = list(p.shape), list(p.shape)
        row[-1], col[-2] = 1, 1
        s["row_var"] = p.new_zeros(row)
        s["col_var"] = p.new_zeros(col)
    else:
        s["variance"] = _zeros(p)
    return s


def _rules() -> dict[type, _StateRule]:
    optim = torch.optim
    return {
        optim.RMSprop: _rmsprop,
        optim.Adamax: _adamax,
        optim.NAdam: _nadam,
        optim.RAdam: _radam,
        optim.ASGD: _asgd,
        optim.Rprop: _rprop,
        optim.Adadelta: _adadelta,
        optim.Adafactor: _adafactor,
    }


def fresh_state(
    opt: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor
) -> dict[str, torch.Tensor] | None:
    """The state ``opt``'s first step creates for parameter ``p`` (on ``p``'s device), or
    None when this module has no rule for ``opt`` (Adam, SGD and torch_xla's syncfree
    optimizers are handled by the workspace; Adagrad creates its state in ``__init__``)."""
    for cls, rule in _rules().items():
        if type(opt) is cls:
            return rule(group, p)
    return None


# Optimizers whose non-capturable update branches on the step count, or passes a value
# computed from it where torch wants a Python number: no single graph replays them.
_NEEDS_CAPTURABLE = ("Adamax", "NAdam", "RAdam", "ASGD", "Rprop")


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
        if name in _NEEDS_CAPTURABLE and not g.get("capturable", False):
            raise ExportError(
                f"{where} was built with capturable=False: its update then turns the "
                "step-count-dependent factors into Python numbers (and branches on them), "
                "so every step would bake different numbers into the graph. Build it with "
                f"torch.optim.{name}(..., capturable=True): it keeps them on the device and "
                "matches the non-capturable update."
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
