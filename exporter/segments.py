"""Activation checkpointing while tracing: ``torch_xla.utils.checkpoint`` watched.

torch_xla's checkpoint is reentrant; a segment none of whose inputs needs grad silently
trains nothing inside it, so the exporter refuses that up front.

Imports: stepbundle.exporter.xla (torch_xla's checkpoint class),
stepbundle.frontend.segments (frontend_core/segments.py: the refusal both front-ends make).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from stepbundle.frontend.segments import refuse_gradless_reentrant_segment

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


def _refuse_gradless_reentrant_segment(run_function: Any, args: Sequence[Any]) -> None:
    """torch_xla's checkpoint is reentrant (``use_reentrant=False`` is not supported on
    XLA): ``frontend_core/segments.py``'s refusal."""
    refuse_gradless_reentrant_segment(
        run_function,
        args,
        "torch_xla.utils.checkpoint (reentrant: use_reentrant=False is not supported on XLA)",
        "",
    )
