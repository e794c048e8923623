"""A training run: batches from a sequence or an iterable, one step (or K) per call.

``Runner`` is the trainer's part behind ``Trainer.run``: it reads the batches, moves the
next one to the device while the current step runs, follows the data position of a
loader, calls ``on_step``, and stops when asked (``request_stop``). With K steps per call
it groups the batches into calls of one bucket (``calls.py``) and runs the rest one step
at a time.

Imports: the trainer's parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..errors import BindingError, DataError
from .calls import Group, StackedCalls
from .dispatch import Dispatcher
from .metrics import StepMetric
from .progress import Progress

__all__ = ["Runner"]

_END: Any = object()  # what next() returns from an exhausted batch iterator


class Runner:
    """Runs ``Trainer.run``'s loop (see ``Trainer.run`` for what it promises).

    Attributes:
      stop_requested: ``request_stop()`` was called during the run in progress; it ends
        after the current step (or call).
    """

    def __init__(self, dispatcher: Dispatcher, calls: StackedCalls, progress: Progress) -> None:
        self.stop_requested = False
        self._d = dispatcher
        self._calls = calls
        self._progress = progress

    def run(
        self,
        batches: Iterable[Mapping[str, Any]],
        steps: int,
        on_step: Callable[[int, dict[str, Any]], object] | None,
        offset: int,
        keep_metrics: bool,
    ) -> list[dict[str, Any]]:
        """``Trainer.run``."""
        out: list[dict[str, Any]] = []
        self.stop_requested = False
        self._d.hp.check_pending()
        if isinstance(batches, Sequence):
            if not batches:
                raise BindingError("run() needs at least one batch.")
            n = len(batches)
            source: Iterator[Mapping[str, Any]] = (batches[(offset + i) % n] for i in range(steps))
            position: Callable[[], Any] | None = None
        else:
            source = iter(batches)
            position = getattr(source, "state", None)
        # A loader of one process's rows in a multi-process job (process_count > 1).
        local = getattr(batches, "process_count", 1) > 1
        if steps <= 0:
            return out
        if position is not None:
            self._progress.data_position = position()
        if self._calls.k > 1:
            return self._run_calls(source, steps, on_step, position, local, keep_metrics)
        first = next(source, _END)
        if first is _END:
            return out
        nxt = self._d.pick("train", first, local)
        failed: BindingError | DataError | None = None
        for i in range(steps):
            plan, dev = nxt
            metrics = self._d.step(plan, dev)
            more = i + 1 < steps
            if position is not None:
                self._progress.data_position = position()  # the batch after this step's
            if more:
                # Dispatch was asynchronous: this transfer overlaps the running step.
                try:
                    following = next(source, _END)
                    more = following is not _END
                    if more:
                        nxt = self._d.pick("train", following, local)
                except (BindingError, DataError) as e:
                    # A batch the data cannot give (a shard truncated under the run) or
                    # no bucket takes: this step ran, so it is reported before the error.
                    failed, more = e, False
            if on_step is not None:
                on_step(i, metrics)
            if keep_metrics or not more or self.stop_requested:
                out.append(metrics)
            if not more or self.stop_requested:
                break
        if failed is not None:
            raise failed
        return out

    def _run_calls(
        self,
        source: Iterator[Mapping[str, Any]],
        steps: int,
        on_step: Callable[[int, dict[str, Any]], object] | None,
        position: Callable[[], Any] | None,
        local: bool,
        keep_metrics: bool,
    ) -> list[dict[str, Any]]:
        """``run`` with K steps per call (see ``run``)."""
        k = self._calls.k
        out: list[dict[str, Any]] = []
        left = steps
        i = 0

        def read(n: int) -> tuple[Group, Exception | None]:
            group: Group = []
            for _ in range(n):
                try:  # a data source failing (a shard truncated) or a batch no bucket takes
                    b = next(source, _END)
                    if b is _END:
                        break
                    plan, arrays = self._d.match(
                        "train", self._d.router.plans_for("train"), b, local
                    )
                except (BindingError, DataError) as e:
                    return group, e  # the steps before it run first
                group.append((plan, arrays, position() if position is not None else None))
            return group, None

        # Calls start at multiples of K steps, so a resumed run's calls end where a
        # run from step 0 would end them (and checkpoints every multiple of K steps
        # fall between calls): single steps up to the next multiple first.
        group, error = read(min((-self._progress.step) % k or k, left))
        prepared = self._calls.stack(group)
        while group:
            left -= len(group)
            metrics = self._calls.dispatch(*prepared) if prepared is not None else None
            if metrics is not None:
                # The call runs: read and move the next group meanwhile.
                nxt, nxt_error = read(min(k, left)) if left > 0 and error is None else ([], error)
                nxt_prepared = self._calls.stack(nxt)
                if group[-1][2] is not None:
                    self._progress.data_position = group[-1][2]
                for j in range(len(group)):
                    m = {name: StepMetric(v, j) for name, v in metrics.items()}
                    if on_step is not None:
                        on_step(i, m)
                    i += 1
                    if keep_metrics:
                        out.append(m)
                    else:
                        out[:] = [m]
            else:
                for plan, arrays, pos in group:
                    m = self._d.step(plan, self._d.router.transfer(plan, arrays, local))
                    if pos is not None:
                        self._progress.data_position = pos
                    if on_step is not None:
                        on_step(i, m)
                    i += 1
                    if keep_metrics:
                        out.append(m)
                    else:
                        out[:] = [m]
                    if self.stop_requested:
                        return out
                nxt, nxt_error = read(min(k, left)) if left > 0 and error is None else ([], error)
                nxt_prepared = self._calls.stack(nxt)
            if self.stop_requested:
                return out
            group, error, prepared = nxt, nxt_error, nxt_prepared
        if error is not None:
            raise error
        return out
