"""The load line ``run`` and ``eval`` print on stderr: what was loaded, how, and what the
load decided (layout, steps per call, fused attention, bf16-out products, the output
head, the allocator, where the initial state came from).

Imports: nothing of the runtime at import time (``--help`` stays fast).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stepbundle.runtime import LoadInfo, Trainer

    from .config import RunConfig

__all__ = ["layout_note", "report_load"]


def _fused_note(fused: dict[str, int]) -> str:
    """``, fused attention: 6 in train[0]`` (``load_info.fused_attention``), or nothing."""
    if not fused:
        return ""
    return ", fused attention: " + ", ".join(f"{n} in {label}" for label, n in fused.items())


def _bf16_note(products: dict[str, tuple[int, int]]) -> str:
    """``, bf16-out products: 51 in train[0] (25 weight gradients swapped)``
    (``load_info.bf16_products``, a TPU), or nothing."""
    if not products:
        return ""
    return ", bf16-out products: " + ", ".join(
        f"{n} in {label}" + (f" ({w} weight gradient{'s' if w != 1 else ''} swapped)" if w else "")
        for label, (n, w) in products.items()
    )


def layout_note(info: LoadInfo, state: bool = True) -> str:
    """``layout fsdp+tp:2, mesh data 2 x model 2, 1.5 MiB of state per device`` (without
    the state's bytes where ``state`` is False: a compile places none)."""
    from .summary import nbytes

    mesh = " x ".join(f"{axis} {size}" for axis, size in info.mesh.items())
    held = f", {nbytes(info.state_bytes_per_device)} of state per device" if state else ""
    return f"layout {info.layout}, mesh {mesh}{held}"


def report_load(args: RunConfig, trainer: Trainer, load_s: float, tag: str = "run") -> None:
    """The load line on stderr (``[run] loaded B in 2.1s (1 compiled, 0 from cache) on cpu``,
    with the layout, steps per call, fused attention and allocator where they apply), then
    the layout's notes, the steps-per-call choice and where the initial state came from;
    ``tag`` is the command (``run``, ``eval``)."""
    from .init_from import report_origins

    n_dev = len(trainer.devices)
    print(
        f"[{tag}] loaded {args.bundle} in {load_s:.2f}s ({trainer.load_info.compiled} compiled, "
        f"{trainer.load_info.cache_hits} from cache) on {args.device}"
        + (f" x{n_dev} ({layout_note(trainer.load_info)})" if n_dev > 1 else "")
        + (f", {trainer.steps_per_call} steps per call" if trainer.steps_per_call > 1 else "")
        + _fused_note(trainer.load_info.fused_attention)
        + _bf16_note(trainer.load_info.bf16_products)
        + (f", glibc {trainer.load_info.allocator}" if trainer.load_info.allocator else ""),
        file=sys.stderr,
    )
    for note in trainer.load_info.layout_notes:  # what the layout did not split, and why
        print(f"[{tag}] layout: {note}", file=sys.stderr)
    for note in trainer.load_info.head_barriers.values():  # the output head weighed (a TPU)
        print(f"[{tag}] output head: {note}", file=sys.stderr)
    for note in trainer.load_info.regather_choice.values():  # fsdp, fsdp+tp: weights re-gathered?
        print(f"[{tag}] regather-weights: {note}", file=sys.stderr)
    if trainer.load_info.auto_steps:  # what steps_per_call="auto" chose, and why
        print(f"[{tag}] {trainer.load_info.auto_steps}", file=sys.stderr)
    report_origins(trainer, args, tag)
