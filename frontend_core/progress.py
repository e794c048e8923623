"""How far a long export is: the stage it is in and, where the stage knows its length, how
far through it (issue #40: a billion-parameter export spends minutes in one stage).

A front-end calls a ``Ticker`` as ``tick(stage, done, total)``: ``stage`` names the stage
("capturing the training step (1 of 2)", "lowering train program 0"), ``done`` counts
its work so far, ``total`` is its length or None when unknown. ``StageLine`` shows it: a
tqdm bar on a terminal (as ``stepbundle run``'s progress), else one line when a stage
starts and one at each quarter of a stage with a length, so that a log shows where a
slow export is.

Imports: the standard library; tqdm when drawing on a terminal.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["StageLine", "Ticker", "no_ticks"]

Ticker = Callable[[str, int, "int | None"], None]
"""``tick(stage, done, total)``: the export is in ``stage``, ``done`` of ``total`` (None:
unknown) units through it."""


def no_ticks(stage: str, done: int, total: int | None) -> None:
    """The ticker of an export nobody watches."""


class StageLine:
    """A ``Ticker`` that shows the current stage on ``file``: a tqdm bar on a terminal,
    else a line per stage and per quarter of it. ``prefix`` starts every plain line."""

    def __init__(self, file: TextIO | None = None, *, prefix: str = "[export] ") -> None:
        self._file = file if file is not None else sys.stderr
        self._prefix = prefix
        self._tty = bool(getattr(self._file, "isatty", lambda: False)())
        self._stage: str | None = None
        self._bar: Any = None
        self._quarter = -1
        self._t0 = time.perf_counter()

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if stage != self._stage:
            self.close()
            self._stage, self._quarter, self._t0 = stage, -1, time.perf_counter()
            if self._tty:
                from tqdm import tqdm

                self._bar = tqdm(
                    total=total,
                    desc=stage,
                    file=self._file,
                    unit="op",
                    leave=False,
                    mininterval=0.5,
                )
            else:
                size = f" ({total:,} operators)" if total else ""
                print(f"{self._prefix}{stage}{size} ...", file=self._file, flush=True)
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
        elif total:
            quarter = 4 * done // total
            if quarter > self._quarter and 0 < quarter < 4:
                seconds = time.perf_counter() - self._t0
                print(
                    f"{self._prefix}{stage}: {25 * quarter}% ({done:,}/{total:,}, {seconds:.0f} s)",
                    file=self._file,
                    flush=True,
                )
            self._quarter = max(self._quarter, quarter)

    def close(self) -> None:
        """End the current stage's bar (the next stage, or the export, is done)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._stage = None
