"""How a single-process ``stepbundle run`` stops at a step boundary on SIGINT, SIGTERM or a
closed stdout, and how a process of a multi-process job ends on SIGTERM.

Imports: the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["StopRequested", "Stopper", "exit_on_sigterm"]


@contextlib.contextmanager
def exit_on_sigterm(enabled: bool) -> Iterator[None]:
    """In a multi-process job, SIGTERM ends this process at once with 143.

    jax's distributed runtime installs its own SIGTERM handler (for preemption notices),
    which left a job's processes running after SIGTERM; only SIGKILL stopped them. The
    processes cannot agree on one step boundary without a collective per step, so there
    is no clean stop: the last checkpoint is where a resume starts.

    A Python handler runs only when the main thread is back in Python, and a process
    waiting in a collective whose peer has gone may never be (seen once in the full
    suite under load: the job's SIGTERM test waited 60 s). So the signal also reaches a
    thread through ``signal.set_wakeup_fd``, written by the interpreter's C handler the
    moment the signal arrives, and whichever of the two comes first ends the process.
    """
    if not enabled:
        yield
        return

    def stop(signum: int) -> None:
        print("\n[run] SIGTERM: stopping this process of the job now", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def watch(fd: int) -> None:
        with open(fd, "rb", buffering=0) as pipe:  # closed when the run is over
            while got := pipe.read(64):  # b"": the write end closed
                if signal.SIGTERM in got:
                    stop(signal.SIGTERM)

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop(signum))
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=watch, args=(read_fd,), name="sigterm-watch", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGTERM, previous)
        os.close(write_fd)  # the watcher reads end-of-file, closes its end and returns


class StopRequested(Exception):
    """Raised from the step callback to end a run at a step boundary."""


class Stopper:
    """Turns SIGINT and SIGTERM (and a closed stdout) into a stop at the next step boundary.

    A scheduler that preempts a job sends SIGTERM; Ctrl-C sends SIGINT. Either way the
    step in flight completes, its state replaces the old, and the run then writes its
    final checkpoint and ``--save-state`` before exiting with 128 + the signal number.
    A second signal while stopping is left to Python's default handling.
    """

    def __init__(self) -> None:
        self.exit_code: int | None = None
        self.reason = ""
        self._previous: dict[int, Any] = {}

    def request(self, exit_code: int, reason: str) -> None:
        if self.exit_code is None:
            self.exit_code, self.reason = exit_code, reason

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.request(128 + signum, signal.Signals(signum).name)
        for sig, handler in self._previous.items():  # a second signal acts at once
            signal.signal(sig, handler)

    @contextlib.contextmanager
    def installed(self, enabled: bool) -> Iterator[Stopper]:
        if enabled:
            for wanted in (signal.SIGINT, signal.SIGTERM):
                self._previous[wanted] = signal.signal(wanted, self._on_signal)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()

    def check(self) -> None:
        if self.exit_code is not None:
            raise StopRequested(self.reason)
