"""How far a long export is: the stage it is in and, where the stage knows its length, how
far through it (issue #40: a billion-parameter export spends minutes in one stage).

A front-end calls a ``Ticker`` as ``tick(stage, done, total)``: ``stage`` names the stage
("capturing the training step (1 of 2)", "lowering train program 0"), ``done`` counts
its work so far, ``total`` is its length or None when unknown. ``StageLine`` shows it: a
tqdm bar on a terminal (as ``stepbundle run``'s progress), else one line when a stage
starts, one at each quarter of a stage with a length, and one every half minute of a
stage without one, so that a log shows where a slow export is. Whole lines (the
front-end's "captured ...", "wrote ..." and the CLI's errors) go through
``StageLine.write``, which clears the bar, prints the line and draws the bar again below
it, so a terminal shows clean lines.

``ticking`` measures a stage that cannot tick by itself (a traced step runs the user's
code): a thread reads a counter of the work done (operators captured so far) twice a
second and ticks with it.

Imports: the standard library; tqdm when drawing on a terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["CHECK_STAGE", "StageLine", "Ticked", "Ticker", "counted", "no_ticks", "ticking"]

Ticker = Callable[[str, int, "int | None"], None]
"""``tick(stage, done, total)``: the export is in ``stage``, ``done`` of ``total`` (None:
unknown) units through it."""

CHECK_STAGE = "checking one step of the bundle against PyTorch eager"
"""The export check's stage (both front-ends): it has no count, only its name."""

UNKNOWN_LENGTH_EVERY_S = 30.0
"""Seconds between two log lines of a stage whose length is unknown (not on a terminal)."""


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun it agrees with, for the export's lines: ``counted(1, "read-only
    entry", "read-only entries")`` is "1 read-only entry"; the plural defaults to
    ``noun + "s"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _has_width(file: TextIO) -> bool:
    """Whether ``file`` is a terminal of a known width: tqdm draws nothing on one of 0
    columns (a pseudo-terminal nobody sized: ``script`` run without a terminal, some CI
    runners), where plain lines are what shows."""
    try:
        return os.get_terminal_size(file.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


def no_ticks(stage: str, done: int, total: int | None) -> None:
    """The ticker of an export nobody watches."""


class StageLine:
    """A ``Ticker`` that shows the current stage on ``file``: a tqdm bar on a terminal
    (of a known width), else a line per stage, per quarter of it, and per half minute of a stage of unknown
    length. ``prefix`` starts every plain line. Safe to call from two threads."""

    def __init__(self, file: TextIO | None = None, *, prefix: str = "[export] ") -> None:
        self._file = file if file is not None else sys.stderr
        self._prefix = prefix
        self._tty = bool(getattr(self._file, "isatty", lambda: False)()) and _has_width(self._file)
        self._stage: str | None = None
        self._bar: Any = None
        self._quarter = -1
        self._t0 = self._said = time.perf_counter()
        self._lock = threading.RLock()

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        with self._lock:
            self._tick(stage, done, total)

    def _tick(self, stage: str, done: int, total: int | None) -> None:
        if stage != self._stage:
            self._close()
            self._stage, self._quarter = stage, -1
            self._t0 = self._said = time.perf_counter()
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
        elif done and time.perf_counter() - self._said >= UNKNOWN_LENGTH_EVERY_S:
            self._said = time.perf_counter()
            seconds = self._said - self._t0
            print(
                f"{self._prefix}{stage}: {done:,} so far ({seconds:.0f} s)",
                file=self._file,
                flush=True,
            )

    def write(self, line: str) -> None:
        """Print ``line`` whole: on a terminal, above the current stage's bar (tqdm clears
        the bar, prints the line and draws the bar again), never inside it."""
        with self._lock:
            if self._bar is not None:
                self._bar.write(line, file=self._file)
                self._file.flush()
            else:
                print(line, file=self._file, flush=True)

    def close(self) -> None:
        """End the current stage's bar (the next stage, or the export, is done)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._stage = None


@dataclass
class Ticked:
    """What ``ticking`` counted: ``done``, the counter's last reading (0 before the end)."""

    done: int = 0


@contextlib.contextmanager
def ticking(
    tick: Ticker,
    stage: str,
    count: Callable[[], int],
    *,
    total: int | None = None,
    every: float = 0.5,
) -> Iterator[Ticked]:
    """Within it, ``tick(stage, count(), total)`` every ``every`` seconds from a thread of
    its own, and once at the start and the end; ``Ticked.done`` holds the last count
    after it. ``count`` must be cheap and safe to call from that thread; an exception
    from it stops the ticking, never the work (it is a progress line)."""
    result = Ticked()
    tick(stage, 0, total)
    if tick is no_ticks:
        yield result
        return
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(every):
            try:
                tick(stage, count(), total)
            except Exception:
                return

    thread = threading.Thread(target=watch, name="stepbundle-progress", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
    with contextlib.suppress(Exception):
        result.done = count()
        tick(stage, result.done, total)
