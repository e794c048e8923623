"""How ``stepbundle run``, ``eval`` and ``compile`` take SIGINT and SIGTERM: at once
while loading (and in every process of a multi-process job), at a step boundary during
the steps of a single-process run, which a closed stdout or a failed sink also stops.

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

__all__ = ["Signals", "StopRequested", "Stopper"]


class Signals:
    """SIGINT and SIGTERM for the whole of a command that loads and compiles (``run``,
    ``eval``, ``compile``): no ``KeyboardInterrupt`` is ever raised.

    Before the steps (and always in a multi-process job) a signal ends the process at
    once, with 128 + the signal number, after one line on stderr and a flush of stdout
    and stderr (``os._exit``): nothing is written yet that an exit could tear. During the
    steps of a single-process run (``stopping_at_boundaries``) the first signal asks the
    run's ``Stopper`` to stop at the next step boundary, and a second ends it at once.

    Why not ``KeyboardInterrupt`` (issue #43, items 2 and 3): raised at whatever line
    the main thread was on, it once landed in jax's garbage-collection callback, was
    printed as "Exception ignored" and lost (the run went on and exited 0), and once
    unwound while XLA's compile threads still ran, so the interpreter shut down under
    them and the process died of SIGSEGV (139) after printing "interrupted".

    The signal is acted on by a thread that reads ``signal.set_wakeup_fd``'s pipe,
    written by the interpreter's C handler the moment the signal arrives: a Python
    handler runs only when the main thread is back in Python, and a compile (or a
    collective whose peer has gone) can keep it away for minutes. (jax's distributed
    runtime installs its own SIGTERM handler too; it is replaced here.)
    """

    def __init__(self) -> None:
        self._stopper: Stopper | None = None
        self.in_job = False  # this process is one of a multi-process job
        self._installed = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[Signals]:
        """Take SIGINT and SIGTERM over for the block (from the main thread only; in any
        other thread nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = {sig: signal.signal(sig, _ignore) for sig in _TAKEN}
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="signals", daemon=True).start()
        self._installed = True
        try:
            yield self
        finally:
            self._installed = False
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(write_fd)  # the watcher reads end-of-file, closes its end and returns

    def retake(self) -> None:
        """Take the signals back from whatever replaced the handlers since ``installed``
        (jax's distributed runtime installs its own SIGTERM handler as a job starts)."""
        if threading.current_thread() is threading.main_thread() and self._installed:
            for sig in _TAKEN:
                signal.signal(sig, _ignore)

    @contextlib.contextmanager
    def stopping_at_boundaries(self, stopper: Stopper, enabled: bool = True) -> Iterator[None]:
        """In the block, a first signal asks ``stopper`` to stop (see the class)."""
        if enabled:
            self._stopper = stopper
        try:
            yield
        finally:
            self._stopper = None

    def _watch(self, fd: int) -> None:
        with open(fd, "rb", buffering=0) as pipe:  # closed when the command is over
            while got := pipe.read(64):  # b"": the write end closed
                for signum in got:
                    if signum in _TAKEN:
                        self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        stopper = self._stopper
        if stopper is not None and stopper.exit_code is None:
            stopper.request(128 + signum, name)
            return
        if self.in_job:
            line = f"[run] {name}: stopping this process of the job now"
        elif stopper is not None:
            line = f"[run] {name} again: stopping now, without a final checkpoint"
        else:
            line = f"stepbundle: interrupted ({name}) before the steps began"
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(Exception):
            print(f"\n{line}", file=sys.stderr, flush=True)
        os._exit(128 + signum)


_TAKEN = (signal.SIGINT, signal.SIGTERM)


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler: the ``Signals`` thread acts; this only keeps Python's
    default (``KeyboardInterrupt``, or death by SIGTERM) away."""


class StopRequested(Exception):
    """Raised from the step callback to end a run at a step boundary."""


class Stopper:
    """A request to stop a run at the next step boundary: from ``Signals`` (SIGINT,
    SIGTERM), a closed stdout or a failed sink.

    A scheduler that preempts a job sends SIGTERM; Ctrl-C sends SIGINT. Either way the
    step (or call) in flight completes, its state replaces the old, and the run then
    writes its final checkpoint and ``--save-state`` before exiting with 128 + the
    signal number. A second signal while stopping ends the process at once (``Signals``).
    """

    def __init__(self) -> None:
        self.exit_code: int | None = None
        self.reason = ""

    def request(self, exit_code: int, reason: str) -> None:
        if self.exit_code is None:
            self.exit_code, self.reason = exit_code, reason

    def check(self) -> None:
        if self.exit_code is not None:
            raise StopRequested(self.reason)
