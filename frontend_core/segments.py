"""Activation checkpointing's one silent trap, refused by both front-ends.

A reentrant checkpoint segment (``torch_xla.utils.checkpoint``, the only kind on XLA;
``torch.utils.checkpoint(..., use_reentrant=True)``, Hugging Face's default) is
differentiated through its inputs only: when none of them requires grad, the parameters
inside it get no gradient and silently stop training (eager PyTorch warns, "None of the
inputs have requires_grad=True"). An exported step would bake that in, so the export is
refused, naming the parameters.

Imports: torch, stepbundle.frontend.errors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .errors import ExportError

__all__ = ["refuse_gradless_reentrant_segment"]


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


def refuse_gradless_reentrant_segment(
    run_function: Any, args: Sequence[Any], checkpoint: str, advice: str
) -> None:
    """Raise ``ExportError`` when ``run_function``, checkpointed reentrantly (by
    ``checkpoint``, the function's name for the message) with ``args``, owns trainable
    parameters and no tensor of ``args`` requires grad; ``advice`` is the front-end's
    way out besides giving the segment an input that requires grad."""
    if not torch.is_grad_enabled():
        return
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return
    params = _segment_parameters(run_function)
    if not params:
        return
    shown = ", ".join(params[:4]) + (" ..." if len(params) > 4 else "")
    raise ExportError(
        f"A {checkpoint} segment receives no input that requires grad, so its parameters "
        f"({shown}) would get no gradients: a reentrant checkpoint is only differentiated "
        "through its inputs. Pass the segment at least one input that requires grad "
        "(checkpoint it after a trainable layer, or call x.requires_grad_() on its input "
        f"first){', ' + advice if advice else ''}, or do not checkpoint that segment."
    )
