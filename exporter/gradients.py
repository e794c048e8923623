"""Which trainable parameters a traced step's backward reaches, and the retraces that follow.

The exporter starts every trainable parameter with a zero gradient, so that the first
traced step is the steady-state one. Two kinds of step need another trace:
``GradientsDropped`` (the step sets gradients to None itself: trace without them) and
``NoGradient`` (parameters no gradient reaches: in eager their grad stays None and the
optimizer skips them, so they are traced again without a zero grad).

Imports: torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["GradientsDropped", "NoGradient", "gradients_reached"]


class GradientsDropped(Exception):
    """The step sets gradients to None: trace again without materialized gradients."""


class NoGradient(Exception):
    """Trainable parameters the step's backward never reached: trace again with their
    gradients None (as in eager), not zeros."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(", ".join(sorted(names)))
        self.names = names


@contextlib.contextmanager
def gradients_reached(model: torch.nn.Module, *, watch: bool) -> Iterator[set[str]]:
    """The names of the trainable parameters a backward accumulated a gradient into
    while the block ran (torch's post-accumulate-grad hooks); empty if not ``watch``."""
    reached: set[str] = set()
    handles = []
    if watch:
        for name, p in model.named_parameters():
            if p.requires_grad:
                handles.append(
                    p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                        lambda _p, n=name: reached.add(n)
                    )
                )
    try:
        yield reached
    finally:
        for h in handles:
            h.remove()
