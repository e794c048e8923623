"""``stepbundle run``'s training loop: steps dispatched ahead of the host, metrics and
logs, periodic evaluation, checkpoints (and what to say when one cannot be written),
stopping at a step boundary on a signal, a closed stdout, a non-finite loss or a data
error.

Imports: the runtime lazily, inside the loop (``--help`` stays fast).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TYPE_CHECKING, Any

from .common import EXIT_PIPE_CLOSED
from .stopping import Signals, Stopper, StopRequested
from .watchdog import Watchdog

if TYPE_CHECKING:
    from stepbundle.runtime import Trainer

    from .config import RunConfig
    from .metrics_file import MetricsFile
    from .report import Reporter

__all__ = ["run_train", "save_state"]

# Calls dispatched and not known to be finished, at most (see run_train's pace): two
# keep the device fed while the host waits for the older one.
_CALLS_AHEAD = 2


def run_train(
    args: RunConfig,
    trainer: Trainer,
    batches: Any,
    steps: int,
    offset: int,
    metrics: MetricsFile | None,
    signals: Signals,
) -> int:
    from stepbundle.runtime.data.dataset import DataError
    from stepbundle.runtime.errors import NonFiniteLossError
    from stepbundle.runtime.io.remote import join
    from stepbundle.schema.errors import CheckpointError

    from .report import Reporter

    start_step = trainer.step_count
    ckpt_dir: str | None = args.checkpoint_dir or None  # a folder or a URL
    stdout = sys.stdout
    stopper = Stopper()
    written: set[int] = set()  # steps whose checkpoint this run wrote

    def checkpoint(name: str | None = None) -> None:
        assert ckpt_dir is not None
        path = join(ckpt_dir, name or f"step-{trainer.step_count:08d}.safetensors")
        reporter.flush()  # the logs hold every step the checkpoint holds
        trainer.save_checkpoint(path)
        written.add(trainer.step_count)
        reporter.note(f"wrote checkpoint {path}")

    failed: list[str] = []  # why each checkpoint this run could not write failed

    def try_checkpoint(name: str | None = None) -> bool:
        """``checkpoint``, with a failure (a full disk) printed and kept, not raised: the
        run then stops and still writes what it can (issue #43, item 6)."""
        assert ckpt_dir is not None
        path = join(ckpt_dir, name or f"step-{trainer.step_count:08d}.safetensors")
        try:
            checkpoint(name)
        except CheckpointError as e:
            failed.append(_why_not_written(e, path))
            reporter.say(failed[-1])  # above the bar, which a periodic one runs under
            return False
        return True

    # In a multi-process job process 0 reports; every process computes.
    reporter = Reporter(
        first_step=start_step,
        steps=steps,
        json_lines=args.json,
        log_every=args.log_every,
        # Rows a killed run wrote past its checkpoint would otherwise come twice: the
        # rows from the resumed step on are cut off now, as this run starts writing.
        metrics_file=metrics if metrics is not None else args.metrics_file,
        resume_at=start_step if args.resume else None,
        tensorboard=args.tensorboard,
        writes_files=trainer.placement.writes_files,
        hyperparameters=lambda: trainer.hyperparameters,
        stdout=stdout,
        stderr=sys.stderr,
        # A sink that fails (a full disk) stops the run at the next step boundary, with
        # its final checkpoint, exit 1; the reporter prints why.
        on_sink_failure=lambda e: stopper.request(1, f"{e.sink} failed"),
    )

    watchdog = Watchdog(args.step_timeout) if args.step_timeout else None
    latest: list[tuple[int, int, dict[str, Any]]] = []

    # The call before this one, by its metric arrays (a K-step call's steps share them).
    before: list[list[Any]] = []

    def pace(metrics: dict[str, Any]) -> None:
        """Wait for the call two before this step's to finish, so that the host never
        runs more than two calls ahead of the device. Dispatch is asynchronous, and with a
        sparse --log-every nothing else waited: a SIGTERM found dozens of steps queued,
        and the run stopped only after all of them (issue #43, item 11)."""
        arrays = [getattr(v, "stack", v) for v in metrics.values()]
        if not arrays or (before and before[-1][0] is arrays[0]):
            return  # no metrics to wait on, or another step of the same call
        before.append(arrays)
        if len(before) > _CALLS_AHEAD:
            for a in before.pop(0):
                wait = getattr(a, "block_until_ready", None)
                if wait is not None:
                    wait()

    def on_step(i: int, metrics: dict[str, Any]) -> None:
        if watchdog is not None:
            watchdog.feed()
        pace(metrics)
        step = start_step + i
        # With --steps-per-call K the state moves K steps per call, and the callbacks of
        # a call's steps come after it: evaluations, checkpoints and stops happen where
        # the state is this step's, between calls (the run aligns calls to multiples of
        # K, and check_outputs made the intervals multiples of K).
        boundary = trainer.step_count == step + 1
        last = i + 1 == steps or (stopper.exit_code is not None and boundary)
        # Kept until the next step: if the data ends first, this was the last step.
        latest[:] = [] if last else [(i, step, metrics)]
        try:
            reporter.step(i, step, metrics, last=last)
            if boundary and args.eval_every and (step + 1) % args.eval_every == 0:
                _evaluate(args, trainer, reporter, step)
        except BrokenPipeError:
            stopper.request(EXIT_PIPE_CLOSED, "stdout was closed")
        if not boundary:
            return
        if stopper.exit_code is not None:
            reporter.close()  # end the bar's line before the stop is reported
        periodic = args.checkpoint_every and (step + 1) % args.checkpoint_every == 0
        if periodic and not try_checkpoint():
            # A full disk: stop, and still write --save-state, which may be elsewhere.
            reporter.close()
            stopper.request(1, "a checkpoint could not be written")
        stopper.check()

    t1 = time.perf_counter()
    code = 0
    # Signals stop a single-process run cleanly. A multi-process job's processes end at
    # once: they cannot agree on one step boundary without a collective per step.
    single = len({d.process_index for d in trainer.devices}) == 1
    with (
        signals.stopping_at_boundaries(stopper, enabled=single),
        watchdog or contextlib.nullcontext(),
        reporter,
    ):
        try:
            trainer.run(batches, steps, on_step=on_step, offset=offset, keep_metrics=False)
            if latest and not reporter.logged(latest[0][1]):
                # The data ended before --steps: its last step is reported as the last.
                reporter.step(*latest[0], last=True)
        except NonFiniteLossError as e:
            reporter.close()
            print(f"\n[run] {e}", file=sys.stderr)
            if ckpt_dir is not None:
                try_checkpoint(f"step-{trainer.step_count:08d}-before-nonfinite.safetensors")
            code = 3
        except DataError as e:  # the data failed under the run (a shard truncated)
            reporter.close()
            print(f"\n[run] stopping after {trainer.step_count} steps: {e}", file=sys.stderr)
            code = 1  # the steps before it ran: the final checkpoint below holds them
        except StopRequested as stop:
            code = stopper.exit_code or 1
            print(f"\n[run] stopping after {trainer.step_count} steps ({stop})", file=sys.stderr)
        trainer.block_until_ready()
        # Every run into a checkpoint folder ends with its final state.
        final = code != 3 and trainer.step_count not in written
        final = final and not failed  # a failed one was this step's, into this folder
        if ckpt_dir is not None and final:
            try_checkpoint()  # says so (Reporter.note), or why not
    if code == 0 and stopper.exit_code is not None:
        code = stopper.exit_code  # a signal after the last step's check
    elapsed = time.perf_counter() - t1
    done = trainer.step_count - start_step
    print(
        f"[run] {done} steps in {elapsed:.2f}s ({done / max(elapsed, 1e-9):.1f} steps/s, "
        f"{trainer.steps_per_call} per call"
        + (" (auto)" if trainer.load_info.auto_steps else "")
        + ")",
        file=sys.stderr,
    )
    if done < steps and code == 0:
        print(f"[run] the data ended after {done} steps (--epochs {args.epochs})", file=sys.stderr)
    saved = None
    if args.save_state:
        try:
            save_state(trainer, args.save_state)
            saved = args.save_state
        except CheckpointError as e:
            if not failed:
                raise
            failed.append(_why_not_written(e, args.save_state))
            print(f"[run] {failed[-1]}", file=sys.stderr)
    if failed:
        code = code if code not in (0, 3) else 1
        _report_unsaved(args, trainer.step_count, saved, written, ckpt_dir)
    return code


def _why_not_written(e: Exception, path: str) -> str:
    """A checkpoint that could not be written, in one sentence that gives no advice the
    ended process could not take ("save again")."""
    cause = e.__cause__ or e.__context__
    if isinstance(cause, OSError):
        return f"could not write {path}: {cause.strerror or cause}"
    return str(e)


def _report_unsaved(
    args: RunConfig, step: int, saved: str | None, written: set[int], ckpt_dir: str | None
) -> None:
    """Say plainly where the state of a run whose checkpoint failed is, if anywhere."""
    from stepbundle.runtime.io.remote import join

    if saved is not None:
        print(f"[run] the state at step {step} is in --save-state {saved}", file=sys.stderr)
        return
    if written and ckpt_dir is not None:
        last = max(written)
        where = f"the last checkpoint written is {join(ckpt_dir, f'step-{last:08d}.safetensors')} (step {last})"
    elif args.resume:
        where = f"this run wrote no checkpoint; it started from {args.resume}"
    else:
        where = "this run wrote no checkpoint"
    print(
        f"[run] nothing of the state at step {step} was saved; {where}. Free space (or give "
        "--save-state on another disk) and resume from there.",
        file=sys.stderr,
    )


def _evaluate(args: RunConfig, trainer: Trainer, reporter: Reporter, step: int) -> None:
    """Evaluate ``--eval-data`` as a whole and report it (``--eval-every``)."""
    from .data import eval_batches

    assert args.eval_data is not None  # check_outputs: --eval-every needs --eval-data
    batches, mask = eval_batches(args.eval_data, trainer, "eval", args.eval_batch_size)
    result = trainer.evaluate_dataset(batches, "eval", mask_key=mask)
    reporter.evaluation(step, result.metrics, result.rows)


def save_state(trainer: Trainer, path: str) -> None:
    # A full checkpoint: --resume takes it, and PyTorch loads it back (load_into).
    trainer.save_checkpoint(path)  # every process takes part; process 0 writes
    if trainer.placement.writes_files:
        print(f"[run] wrote state to {path}", file=sys.stderr)
