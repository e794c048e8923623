"""The state a fresh optimizer creates on its first step, made before the trace: the one
optimizer table both front-ends use.

A bundle replays the steady-state step, so the state a fresh optimizer creates lazily
on its first step is made first, exactly as torch would make it (same keys, order,
shapes, dtypes and values as each optimizer's ``_init_group``, torch 2.9-2.14): Adam and
AdamW, SGD, and by ``fresh_state`` RMSprop, Adamax, NAdam, RAdam, ASGD, Rprop, Adadelta
and Adafactor (Adagrad creates its state in ``__init__``). The torch_xla front-end places
``step`` on the device when the optimizer keeps it there.

``take_capturable``: the optimizers whose non-capturable update reads the step count on
the host and branches on it (``NEEDS_CAPTURABLE``) are traced with ``capturable=True``
by both front-ends, the same update with the step count a tensor; the export line says
so.

Imports: torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import ExportError

__all__ = [
    "NEEDS_CAPTURABLE",
    "adam_first_state",
    "described",
    "fresh_state",
    "sgd_first_state",
    "take_capturable",
]


def adam_first_state(
    group: Mapping[str, Any], p: torch.Tensor, step: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Adam's and AdamW's state before their first step: ``step`` as given, zero moments
    (and a zero ``max_exp_avg_sq`` with amsgrad)."""
    s = {
        "step": step,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group["amsgrad"]:
        s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return s


def sgd_first_state(
    opt: torch.optim.Optimizer, group: Mapping[str, Any], p: torch.Tensor
) -> dict[str, torch.Tensor]:
    """SGD's state before its first step: a zero momentum buffer, or nothing without
    momentum.

    A zero buffer gives exactly the first step's ``clone(grad)`` when dampening is 0
    (``momentum * 0 + grad``).

    Raises:
      ExportError: momentum with dampening, whose first step no steady-state step replays.
    """
    if group["momentum"] == 0:
        return {}
    if group["dampening"] != 0:
        raise ExportError(
            f"{type(opt).__name__} with momentum={group['momentum']} and "
            f"dampening={group['dampening']} starts its momentum buffer from the first "
            "gradient, which no steady-state step can replay. Take one optimizer step "
            "before exporting, or use dampening=0."
        )
    return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}


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


def described(
    made: Mapping[str, torch.Tensor], one: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Made state without its memory, on the CPU: each tensor of ``made`` (read for its
    shape and dtype only: on ``meta``, or on a device) as the one element the same rule
    made in ``one`` (made for a one-element parameter), expanded to its shape. Every rule
    here fills its tensors with one value that depends on the optimizer's settings, never
    on the parameter's values; an empty tensor stays empty."""
    out: dict[str, torch.Tensor] = {}
    for key, m in made.items():
        if m.numel() == 0:
            out[key] = torch.empty(tuple(m.shape), dtype=m.dtype)
            continue
        e = one[key].detach().reshape(-1)[:1].to(m.dtype).cpu()
        out[key] = e.reshape(()).expand(m.shape) if m.dim() else e.reshape(()).clone()
    return out


NEEDS_CAPTURABLE = ("Adamax", "NAdam", "RAdam", "ASGD", "Rprop")
"""Optimizers whose non-capturable update turns step-count-dependent factors into Python
numbers and branches on them (RAdam's ``rho_t > 5``, ASGD's ``eta``...): no single graph
replays them, so both front-ends trace them with ``capturable=True``."""


def take_capturable(
    opt: torch.optim.Optimizer, needs: tuple[str, ...] = NEEDS_CAPTURABLE
) -> str | None:
    """Set ``capturable=True`` on ``opt``'s param groups where its traced update needs it
    (``needs``: the optimizers' class names; the caller restores ``param_groups`` after
    tracing); returns the note for the export line, or None when nothing changed."""
    name = type(opt).__name__
    if name not in needs or type(opt).__module__.split(".")[0] != "torch":
        return None
    changed = [i for i, g in enumerate(opt.param_groups) if not g.get("capturable", False)]
    for i in changed:
        opt.param_groups[i]["capturable"] = True
    if not changed:
        return None
    return (
        f"{name} was built with capturable=False; its update was traced with "
        "capturable=True (torch's same update with the step count kept a tensor, which a "
        "replayed program needs: the non-capturable one reads it on the host and branches "
        "on it). Your optimizer object is unchanged."
    )
