"""``--step-timeout``: stop a job whose steps make no progress.

A step that never finishes (a collective waiting for a process that died or hung; a
2-process CPU job over gloo was seen to hang this way, with plain jax too) leaves every
process of a job blocked in native code, where no Python exception can reach it. The
watchdog is a daemon thread that the step loop feeds after every step; if no step is
fed for ``timeout_s`` seconds it prints one line and ends the process with exit code
124, at once (``os._exit``: the main thread is stuck, so nothing else could run). Every
process of a job runs its own, so a hang stops them all.

Imports: the standard library only.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_STEP_TIMEOUT", "Watchdog"]

EXIT_STEP_TIMEOUT = 124  # the exit code of timeout(1), which this is


def _exit(message: str) -> None:
    print(f"stepbundle: error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_STEP_TIMEOUT)


class Watchdog:
    """Calls ``on_timeout(message)`` if ``feed`` is not called for ``timeout_s`` seconds.

    Use as a context manager around the step loop; ``feed()`` after every step. The
    default ``on_timeout`` prints the message and exits the process with 124.
    """

    def __init__(
        self, timeout_s: float, on_timeout: Callable[[str], None] = _exit, what: str = "step"
    ) -> None:
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._what = what
        self._last = time.monotonic()
        self._steps = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stepbundle-watchdog", daemon=True)

    def feed(self) -> None:
        self._last = time.monotonic()
        self._steps += 1

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._on_timeout(
                    f"no {self._what} finished for {idle:.0f}s (--step-timeout "
                    f"{self.timeout_s:g}) after {self._steps} steps; stopping this process. "
                    "In a multi-process job a process that died or hung stops the others in "
                    "a collective: every process's watchdog ends it. Resume from the last "
                    "checkpoint."
                )
                return

    def __enter__(self) -> Watchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
