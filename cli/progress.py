"""The training progress bar of ``stepbundle run`` on a terminal (tqdm).

It counts *completed* steps: the run loop dispatches steps asynchronously, so a step
counts only once one of its metrics has been read (which waits for it). Reading costs a
device round trip, so the bar reads at most :data:`REFRESH_S` apart, not every step;
between two refreshes it shows the last completed count, and tqdm's rate and ETA come
from those counts. tqdm redraws the whole line and pads it with spaces, so a shorter
number never leaves digits of a longer one behind.

Imports: tqdm and the standard library (it is given plain floats, never device arrays).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = ["REFRESH_S", "ProgressBar", "format_value"]

# Seconds between two refreshes: reading a metric waits for its step, and about ten
# reads a second cost nothing measurable, where reading the loss every step slows a
# small model's steps markedly.
REFRESH_S = 0.1


def format_value(x: float) -> str:
    """A metric as the bar and the plain lines show it: 6 significant digits."""
    return f"{x:.6g}" if math.isfinite(x) else str(x)


_FALLBACK_COLUMNS = 120


def _columns(file: TextIO) -> int | None:
    """The width of the terminal ``file`` writes to, or None if it reports none."""
    try:
        columns = os.get_terminal_size(file.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None
    return columns or None


class ProgressBar:
    """One terminal line: completed global steps, rate, ETA, the lr and every scalar metric.

    Steps are global (a resumed run starts at its checkpoint's step): ``first`` is the
    step count before the run, ``total`` the count the run ends at.
    """

    def __init__(self, first: int, total: int, file: TextIO) -> None:
        from tqdm import tqdm

        self._last = -math.inf
        # Follow the terminal's width; a terminal that reports none (a pseudo-terminal
        # nobody sized, some CI runners) would get an empty line from tqdm.
        width = _columns(file)
        self._bar: Any = tqdm(
            total=total,
            initial=first,
            file=file,
            unit="step",
            dynamic_ncols=width is not None,
            ncols=None if width is not None else _FALLBACK_COLUMNS,
            # This class throttles (see REFRESH_S); tqdm draws on every update it gets.
            mininterval=0,
            miniters=1,
            leave=True,
        )

    def due(self) -> bool:
        """Whether enough time has passed since the last refresh to read metrics again."""
        return time.perf_counter() - self._last >= REFRESH_S

    def update(self, completed: int, scalars: Mapping[str, float], lr: float | None) -> None:
        """Show ``completed`` global steps done, with ``scalars`` (read from the last of
        them) and the ``lr`` it ran with."""
        self._last = time.perf_counter()
        parts = [f"{k} {format_value(v)}" for k, v in scalars.items()]
        if lr is not None:
            parts.append(f"lr {lr:.3g}")
        self._bar.set_postfix_str("  ".join(parts), refresh=False)
        delta = completed - self._bar.n
        if delta > 0:
            self._bar.update(delta)  # draws, and feeds tqdm's rate estimate
        else:
            self._bar.refresh()

    def write(self, line: str, file: TextIO) -> None:
        """Print ``line`` to ``file`` above the bar, which is redrawn below it."""
        self._bar.write(line, file=file)

    def close(self) -> None:
        """Leave the bar's last state on screen and end its line (idempotent)."""
        self._bar.close()
