"""Activation checkpointing while tracing: ``torch_xla.utils.checkpoint`` watched.

torch_xla's checkpoint is reentrant; a segment none of whose inputs needs grad silently
trains nothing inside it, so the exporter refuses that up front.

Imports: torch, stepbundle.exporter.xla (torch_xla's checkpoint class),
stepbundle.frontend.errors (frontend_core/errors.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from stepbundle.frontend.errors import ExportError

from . import xla

__all__ = ["counting_checkpoints"]


@contextlib.contextmanager
def counting_checkpoints() -> Iterator[list[int]]:
    """Counts the calls of ``torch_xla.utils.checkpoint`` within it (a one-element list),
    and refuses a reentrant segment whose parameters would get no gradient."""
    fn = xla.checkpoint_function()
    saved = fn.__dict__["forward"]
    calls = [0]

    def forward(ctx: Any, *args: Any) -> Any:
        calls[0] += 1
        return saved.__func__(ctx, *args)

    # apply, not forward, sees the caller's grad mode (autograd runs forward without grad).
    own_apply = fn.__dict__.get("apply")
    saved_apply = fn.apply

    def apply(cls: Any, run_function: Any, preserve: Any, *args: Any) -> Any:
        _refuse_gradless_reentrant_segment(run_function, args)
        return saved_apply(run_function, preserve, *args)

    fn.forward = staticmethod(forward)
    fn.apply = classmethod(apply)
    try:
        yield calls
    finally:
        fn.forward = saved
        if own_apply is not None:  # pragma: no cover - torch_xla 2.9 inherits apply
            fn.apply = own_apply
        else:
            del fn.apply


def _segment_parameters(run_function: Any) -> list[str]:
    """The trainable parameters a checkpointed segment visibly owns, by name: those of
    a module, of a module's bound method, or of either wrapped in ``functools.partial``."""
    fn = run_function
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        return []
    return [n for n, p in owner.named_parameters() if p.requires_grad]


def _refuse_gradless_reentrant_segment(run_function: Any, args: Sequence[Any]) -> None:
    """torch_xla's checkpoint is reentrant: a segment none of whose tensor inputs needs
    grad runs without autograd, so the parameters inside it get no gradient and silently
    stop training (torch's documented behaviour of ``use_reentrant=True``)."""
    if not torch.is_grad_enabled():
        return
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return
    params = _segment_parameters(run_function)
    if not params:
        return
    shown = ", ".join(params[:4]) + (" ..." if len(params) > 4 else "")
    raise ExportError(
        "A torch_xla.utils.checkpoint segment receives no input that requires grad, so "
        f"its parameters ({shown}) would get no gradients: torch_xla's checkpoint is "
        "reentrant (use_reentrant=False is not supported on XLA), and a reentrant "
        "segment is only differentiated through its inputs. Pass the segment at least "
        "one input that requires grad (checkpoint it after a trainable layer, or call "
        "x.requires_grad_() on its input first), or do not checkpoint that segment."
    )
