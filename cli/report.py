"""What ``stepbundle run`` reports per training step, and when it reads the metrics.

One :class:`Reporter` per run fans each step out to ``--json`` lines, plain lines or the
terminal's progress bar, ``--metrics-file`` and ``--tensorboard``. Reading a step's
metrics waits for that step (dispatch is asynchronous), so a step's metrics are read
only if something reports it, and at most once.

Which steps are reported:

- ``--json``: every step, or with ``--log-every N`` every step whose count ``step + 1``
  is a multiple of N, and the run's last step.
- plain lines (no ``--json``, stdout not a terminal-with-bar): about ten per run (the
  first step, then every ``steps // 10``), or the ``--log-every`` steps as above.
- the progress bar (stderr a terminal, no ``--json``): about ten refreshes a second and
  the last step; with ``--log-every``, the plain lines are printed above it.
- ``--metrics-file`` and ``--tensorboard``: every step, or the ``--log-every`` steps.

Only the process that writes files (process 0 of a multi-process job) reports.

Imports: the standard library, ``stepbundle.runtime.train.metrics`` (numpy), the CLI's
``progress`` (tqdm), ``sinks`` and ``metrics_file`` modules; tensorboardX through
``sinks``, lazily.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TextIO

from stepbundle.runtime.train.metrics import json_safe, to_floats

from .metrics_file import MetricsFile
from .progress import ProgressBar, format_value
from .sinks import LogRecord, Sink, SinkError, TensorBoard, lr_name

__all__ = ["Reporter", "plain_line"]


def plain_line(step: int, metrics: Mapping[str, float | list[float]], lr: float | None) -> str:
    """``step     41  loss 1.829600  accuracy 0.53125  lr 0.001`` (scalar metrics only)."""
    parts = [f"step {step:6d}"]
    if isinstance(loss := metrics.get("loss"), float):
        parts.append(f"loss {loss:.6f}")
    parts += [
        f"{k} {format_value(v)}" for k, v in metrics.items() if k != "loss" and isinstance(v, float)
    ]
    if lr is not None:
        parts.append(f"lr {lr:.6g}")
    return "  ".join(parts)


class Reporter:
    """Reports the steps of one training run; use as a context manager, or call
    :meth:`close` on every way out (it closes the bar and the sinks, idempotently).

    Args:
      first_step: the trainer's step count before the run (a resumed run's checkpoint).
      steps: how many steps this run dispatches.
      json_lines: ``--json``: one JSON object per reported step on ``stdout``.
      log_every: ``--log-every``, or None for each output's default.
      metrics_file, tensorboard: ``--metrics-file`` and ``--tensorboard``, or None; the
        metrics file as a path, or a ``MetricsFile`` the run opened (and locked) earlier.
      resume_at: the step a resumed run starts at: rows of that step and later that end
        the metrics file were left by the run the checkpoint came from and are cut off
        (``MetricsFile.start``); None for a run that is not resumed.
      writes_files: False in every process of a multi-process job but process 0: then
        nothing is read, printed or opened.
      hyperparameters: returns the current hyperparameters (``trainer.hyperparameters``);
        called right after a step is dispatched, when they are that step's.
      stdout, stderr: where lines and the bar go; the bar only if ``stderr`` is a
        terminal and ``json_lines`` is off.
      on_sink_failure: called once, with the ``SinkError``, when a sink fails to write,
        sync or close (a full disk): the run should stop at its next step boundary.
        The failed sink's file was cut back to its last whole record and closed; the
        message is printed on ``stderr``; the other sinks go on; ``failure`` keeps it.
    """

    def __init__(
        self,
        *,
        first_step: int,
        steps: int,
        json_lines: bool,
        log_every: int | None,
        metrics_file: str | MetricsFile | None,
        tensorboard: str | None,
        writes_files: bool,
        hyperparameters: Callable[[], Mapping[str, float]],
        stdout: TextIO,
        stderr: TextIO,
        on_sink_failure: Callable[[SinkError], object] | None = None,
        resume_at: int | None = None,
    ) -> None:
        self._steps = steps
        self._json = json_lines
        self._every = log_every
        self._writes = writes_files
        self._hyper = hyperparameters
        self._stdout = stdout
        self._stderr = stderr
        self._on_failure = on_sink_failure
        self.failure: SinkError | None = None
        self._t0 = time.perf_counter()
        self._sinks: list[Sink] = []
        self._bar: ProgressBar | None = None
        self._notes_lost = False  # stderr could not be written: notes are dropped
        if not writes_files:
            return
        try:
            if metrics_file is not None:
                lines = (
                    metrics_file
                    if isinstance(metrics_file, MetricsFile)
                    else MetricsFile(metrics_file)
                )
                self._sinks.append(lines)
                lines.start(resume_at)
                if lines.torn_bytes:
                    print(
                        f"[run] --metrics-file: cut a torn last line ({lines.torn_bytes} "
                        f"bytes, no newline) off {lines.path!r} before appending",
                        file=stderr,
                    )
                if lines.dropped:
                    print(
                        f"[run] dropped {lines.dropped} line(s) of {lines.path} from step "
                        f"{resume_at} on, left by the run the checkpoint came from",
                        file=stderr,
                    )
            if tensorboard is not None:
                self._sinks.append(TensorBoard(tensorboard))
        except BaseException:
            self.close()
            raise
        if not json_lines and stderr.isatty():
            self._bar = ProgressBar(first_step, first_step + steps, stderr)

    def __enter__(self) -> Reporter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _logged(self, step: int, last: bool) -> bool:
        """Whether ``--log-every`` selects this step (True for every step without it)."""
        return self._every is None or last or (step + 1) % self._every == 0

    def logged(self, step: int) -> bool:
        """Whether ``step``, not the last, was written to the logs when it was reported."""
        return self._logged(step, False)

    def step(self, i: int, step: int, metrics: Mapping[str, Any], *, last: bool) -> None:
        """Report the ``i``-th step of this run (global ``step``), just dispatched.

        ``last``: no step follows in this run (its end, or a stop), so the bar and the
        ``--log-every`` outputs take this one whatever their schedule.
        """
        if not self._writes:
            return
        logged = self._logged(step, last)
        if self._json:
            plain = False
        elif self._every is not None:
            plain = logged
        else:  # the default plain lines, when there is no bar: about ten a run
            plain = self._bar is None and ((i + 1) % max(1, self._steps // 10) == 0 or i == 0)
        bar = self._bar is not None and (last or self._bar.due())
        sinks = bool(self._sinks) and logged
        if not ((self._json and logged) or plain or bar or sinks):
            return  # nothing reads this step's metrics: the loop runs on without waiting
        floats = to_floats(metrics)  # waits for this step to finish
        hyper = self._hyper() if (plain or bar or sinks) else {}
        name = lr_name(hyper)
        lr = None if name is None else hyper[name]
        if self._json and logged:
            self._stdout.write(json.dumps({"step": step, **json_safe(floats)}) + "\n")
        if plain:
            line = plain_line(step, floats, lr)
            if self._bar is not None:
                self._bar.write(line, self._stdout)
            else:
                self._stdout.write(line + "\n")
        if bar:
            assert self._bar is not None
            scalars = {k: v for k, v in floats.items() if isinstance(v, float)}
            self._bar.update(step + 1, scalars, lr)
        if sinks:
            record = LogRecord(step, time.perf_counter() - self._t0, dict(hyper), floats)
            self._to_sinks(lambda sink: sink.write(record))

    def evaluation(self, step: int, metrics: Mapping[str, float], rows: int) -> None:
        """Report an evaluation over ``--eval-data`` made after global step ``step``: a
        line on stdout (JSON with ``--json``), and a record for every sink."""
        if not self._writes:
            return
        if self._json:
            line = json.dumps({"step": step, "eval": json_safe(dict(metrics)), "rows": rows})
        else:
            shown = "  ".join(f"{k} {v:.6g}" for k, v in metrics.items())
            line = f"eval after {step + 1} steps: {shown}  ({rows} rows)"
        if self._bar is not None:
            self._bar.write(line, self._stdout)
        else:
            self._stdout.write(line + "\n")
        record = LogRecord(step, time.perf_counter() - self._t0, {}, dict(metrics), "eval")
        self._to_sinks(lambda sink: sink.write(record))

    def note(self, text: str) -> None:
        """``[run] text`` on ``stderr`` (above the bar while there is one), in the process
        that writes files only. A note is news, not the run's output: once ``stderr``
        cannot be written (its reader gone), later notes are dropped and the run goes on,
        as it did before it said its checkpoints."""
        if not self._writes or self._notes_lost:
            return
        line = f"[run] {text}"
        try:
            if self._bar is not None:
                self._bar.write(line, self._stderr)
            else:
                print(line, file=self._stderr, flush=True)
        except OSError:  # BrokenPipeError, EIO of a closed terminal
            self._notes_lost = True

    def say(self, text: str) -> None:
        """``[run] text`` on ``stderr``, above the bar while there is one: why the run
        stops (a checkpoint or a sink that could not be written). A plain print landed on
        the bar's line, and the bar was drawn again above the message when it closed.
        Unlike a note it is said in every process; once ``stderr`` cannot be written it
        is lost, and the run goes on stopping."""
        line = f"[run] {text}"
        with contextlib.suppress(OSError):  # BrokenPipeError, EIO of a closed terminal
            if self._bar is not None:
                self._bar.write(line, self._stderr)
            else:
                print(line, file=self._stderr, flush=True)

    def _to_sinks(self, call: Callable[[Sink], object]) -> None:
        """``call`` each sink; a sink whose call fails is dropped (see ``on_sink_failure``)."""
        for sink in list(self._sinks):
            try:
                call(sink)
            except SinkError as e:
                self._sinks.remove(sink)
                with contextlib.suppress(SinkError):
                    sink.close()
                self._failed(e)

    def _failed(self, e: SinkError) -> None:
        if self.failure is not None:
            return
        self.failure = e
        self.say(str(e))
        if self._on_failure is not None:
            self._on_failure(e)

    def flush(self) -> None:
        """Put every reported step on disk: called when a checkpoint is written, so a
        run killed later and resumed from it leaves no hole in the logs. Every record
        is written through as it comes (so a SIGKILL loses none); this also syncs the
        files to the disk, for a machine that goes down."""
        self._to_sinks(lambda sink: sink.flush())

    def close(self) -> None:
        """End the bar's line, then flush and close every sink (each exactly once)."""
        bar, self._bar = self._bar, None
        sinks, self._sinks = self._sinks, []
        with contextlib.ExitStack() as stack:
            for sink in sinks:
                stack.callback(self._close_sink, sink)
            if bar is not None:
                bar.close()

    def _close_sink(self, sink: Sink) -> None:
        try:
            sink.close()
        except SinkError as e:
            self._failed(e)
