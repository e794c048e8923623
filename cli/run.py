"""``stepbundle run``: run a bundle's steps in a lean process (no torch).

Imports: the runtime (lazily, so ``--help`` stays fast), numpy.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

from stepbundle.schema.errors import UsageError

from .common import EXIT_PIPE_CLOSED
from .common import die as _die
from .config import RunConfig
from .stopping import Signals, Stopper, StopRequested
from .watchdog import Watchdog

if TYPE_CHECKING:
    from stepbundle.runtime import LoadInfo, Trainer

    from .metrics_file import MetricsFile
    from .report import Reporter

__all__ = ["cmd_run"]


# ---------------------------------------------------------------------- run
def _scalar(v: Any) -> Any:
    """One metric for a JSON line: a float, or a list of floats for a metric with several
    elements; non-finite values as the strings "NaN", "Infinity", "-Infinity"."""
    from stepbundle.runtime.train.metrics import to_json_floats

    return to_json_floats({"value": v})["value"]


# Virtual CPU devices are for trying data parallelism on one machine; thousands of them
# take seconds and gigabytes to create before anything could refuse the run.
_MAX_CPU_DEVICES = 256


def refuse_too_many_cpu_devices(args: RunConfig) -> None:
    """``--devices N`` on the CPU makes N virtual devices: refuse a count past
    ``_MAX_CPU_DEVICES`` before jax spends seconds and gigabytes making them (run, eval)."""
    platform = args.device.partition(":")[0].lower()
    if platform == "cpu" and isinstance(args.devices, int) and args.devices > _MAX_CPU_DEVICES:
        raise UsageError(
            f"--devices {args.devices} on the CPU would create that many virtual devices; at "
            f"most {_MAX_CPU_DEVICES} are allowed (they share this machine's "
            f"{os.cpu_count()} cores). Use a smaller number."
        )


def _join_job(args: RunConfig) -> bool:
    """Set up devices before jax starts: virtual CPU devices, and the multi-process job.

    Returns whether this process joined a multi-process job.
    """
    from stepbundle.runtime.placement import distributed

    multi = args.distributed or args.coordinator is not None
    if not multi and (args.num_processes is not None or args.process_id is not None):
        raise UsageError("--num-processes and --process-id need --coordinator HOST:PORT")
    cpu_devices = None
    platform = args.device.partition(":")[0].lower()
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    refuse_too_many_cpu_devices(args)
    if platform == "cpu" and isinstance(args.devices, int) and args.devices > 1 and not forced:
        processes = args.num_processes or 1
        cpu_devices = -(-args.devices // processes)
    if multi and args.devices == 1:
        raise UsageError(
            "A multi-process job runs one data-parallel program over its devices: pass "
            "--devices all (or a number that covers every process's devices)."
        )
    if multi:
        _records_only_on_stdout()
        distributed.initialize(
            args.coordinator, args.num_processes, args.process_id, cpu_devices=cpu_devices
        )
    elif cpu_devices is not None:
        distributed.set_cpu_devices(cpu_devices)
    return multi


def _records_only_on_stdout() -> None:
    """Keep stdout for the command's own records (``--json``) in a multi-process job.

    The collectives' C++ library (gloo, on the CPU) prints "[Gloo] Rank N is connected to
    ..." lines on the process's standard output, where they would break a reader of the
    JSON records. From here on, file descriptor 1 is stderr for whatever writes to it
    directly, and Python's ``sys.stdout`` writes to the original stdout (a duplicate of
    it). Before anything holds ``sys.stdout``: called before the job is joined.
    """
    sys.stdout.flush()
    records = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = open(  # noqa: SIM115 - the process's stdout from now on
        records,
        "w",
        buffering=1 if sys.stdout.line_buffering else -1,
        encoding=sys.stdout.encoding,
        errors=sys.stdout.errors,
    )


# Calls dispatched and not known to be finished, at most (see _run_train's pace): two
# keep the device fed while the host waits for the older one.
_CALLS_AHEAD = 2

# How long the processes of a job wait for each other to load (cold compiles included).
_SETUP_TIMEOUT_S = 1800.0


def cmd_run(args: argparse.Namespace) -> int:
    # SIGINT and SIGTERM end the load at once, and stop the steps at a boundary: never a
    # KeyboardInterrupt inside jax (stopping.Signals says why).
    with Signals().installed() as signals:
        return _cmd_run(RunConfig.from_args(args), signals)


def _cmd_run(args: RunConfig, signals: Signals) -> int:
    from stepbundle.runtime.placement import distributed
    from stepbundle.schema.errors import StepbundleError

    from .data import NOT_READ, check_steps_per_call, open_data
    from .outputs import check_outputs
    from .paths import check_path_kinds, refuse_missing_resume, resume_from_folder

    try:
        args = resume_from_folder(args)  # --resume DIR: its latest checkpoint
        check_path_kinds(args)  # a FIFO or device would block the first open for ever
        # A refused run creates no output folder or file: the data are read first. In a
        # multi-process job they (and --resume) are checked after the load, which needs
        # every process, so that the others hear of a refusal through fail() rather than
        # wait for this process inside the load.
        alone = not (args.distributed or args.coordinator is not None)
        if alone:
            refuse_missing_resume(args)
        npz = open_data(args) if alone else NOT_READ
        args = check_outputs(args)  # a sha256: bundle's file, the sinks' local paths
        check_steps_per_call(args, npz)  # K batches that cannot fit in memory
    except (OSError, ValueError) as e:
        return _die(str(e), 2)
    try:
        joined = _join_job(args)
    except ValueError as e:
        return _die(str(e), 2)
    except StepbundleError as e:
        return _die(str(e), 1)
    if joined:
        signals.in_job = True
        signals.retake()  # jax.distributed installed its own SIGTERM handler

    def fail(message: str, code: int) -> int:
        # In a job, tell the other processes, which would otherwise wait for this one
        # in their first step.
        if joined:
            with contextlib.suppress(StepbundleError):
                distributed.agree(False, timeout_s=_SETUP_TIMEOUT_S)
        return _die(message, code)

    from .folder_lock import lock_for_run
    from .metrics_file import MetricsFileRefusedError, metrics_file_for_run
    from .record_file import SinkError

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(lock_for_run(args, joined))
            metrics = metrics_file_for_run(args, joined)
        except (ValueError, MetricsFileRefusedError) as e:
            return fail(str(e), 2)
        except SinkError as e:
            return fail(str(e), 1)
        if metrics is not None:
            held.callback(metrics.close)
        return _load_and_run(args, joined, fail, metrics, npz, signals)


def _load_and_run(
    args: RunConfig,
    joined: bool,
    fail: Callable[[str, int], int],
    metrics: MetricsFile | None,
    npz: Any,
    signals: Signals,
) -> int:
    from stepbundle.runtime.placement import distributed
    from stepbundle.schema.errors import StepbundleError

    from .data import NOT_READ, open_data, training_batches

    try:
        t0 = time.perf_counter()
        trainer = _open_trainer(args)
        load_s = time.perf_counter() - t0
        if npz is NOT_READ:  # a job's: read where every process has loaded (see fail)
            npz = open_data(args)  # a UsageError: exit 2
        if args.eval_data and "eval" not in trainer.entries:
            return fail(
                f"--eval-data evaluates the bundle's 'eval' entry, and {args.bundle} has "
                f"none (its entries: {', '.join(trainer.entries)}). Export it with "
                "Recipe(eval_step=...), or drop --eval-data.",
                2,
            )
        batches, offset = training_batches(args, trainer, npz)
    except UsageError as e:  # an option the load refused (--layout, a schedule): exit 2
        return fail(str(e), 2)
    except (StepbundleError, ValueError) as e:
        return fail(str(e), 1)
    try:
        if joined and not distributed.agree(True, timeout_s=_SETUP_TIMEOUT_S):
            return _die("another process of the job failed to start; its error says why", 1)
    except StepbundleError as e:
        return _die(str(e), 1)
    report_load(args, trainer, load_s)
    try:
        if args.entry != "train":
            return _run_eval(args, trainer, batches)
        steps = args.steps
        if steps is None:  # the parser takes --steps or --until-step, one of them
            assert args.until_step is not None
            steps = args.until_step - trainer.step_count
        if steps <= 0:
            print(
                f"[run] the trainer is at step {trainer.step_count}, at or past --until-step "
                f"{args.until_step}: nothing to do",
                file=sys.stderr,
            )
            if args.save_state:  # the state asked for is the resumed one
                _save_state(trainer, args.save_state)
            return 0
        return _run_train(args, trainer, batches, steps, offset, metrics, signals)
    except StepbundleError as e:
        return _die(str(e), 1)


def _open_trainer(args: RunConfig) -> Trainer:
    """Load the bundle, then restore ``--resume`` and apply ``--seed``, schedules and
    ``--set``. With ``--steps-per-call auto`` (or none, off the CPU) the load chooses K,
    kept to the checkpoint and evaluation cadences, and ``load_info.auto_steps`` says what
    it chose; a schedule that clashes with the resumed checkpoint's is the trainer's
    refusal (``Trainer.set_schedule``)."""
    from stepbundle.runtime import (
        CompileOptions,
        LoadOptions,
        SafetyOptions,
        load,
    )
    from stepbundle.runtime.train.schedule import named_schedule

    from .init_from import state_options
    from .options import head_barriers, parallel_options
    from .paths import refuse_missing_resume

    train = args.entry == "train"
    options = LoadOptions(
        compile=CompileOptions(
            # An evaluation run compiles only its entry (the training buckets need not
            # split over the devices then).
            entries=None if train else (args.entry,),
            cache_dir=False if args.no_cache else (args.cache_dir or True),
            steps_per_call=_steps_per_call(args),
            cadences=(args.checkpoint_every or 0, args.eval_every or 0),
            matmul_precision=args.matmul_precision,
            fused_attention=not args.no_fused_attention,
            bf16_products=not args.no_bf16_products,
            regather_weights=not args.no_regather_weights,
            head_barriers=head_barriers(args),
        ),
        state=state_options(args),
        safety=SafetyOptions(
            expect_digest=args.expect_digest or args.bundle_digest,
            stop_on_nonfinite=args.stop_on_nonfinite,
            check_state=args.check_state,
        ),
        parallel=parallel_options(args),
    )
    # A sha256: bundle was found and verified in the store once (outputs._check_bundle);
    # the load reads that file, held to the digest, rather than verify it again.
    trainer = load(args.bundle_file or args.bundle, args.device, options=options)
    if args.resume:
        # Alone, checked before anything loads; in a job, here, where every process has
        # loaded (the load's collectives need them all), so that a refusal reaches the
        # others through fail() instead of leaving them waiting in the load.
        refuse_missing_resume(args)
        trainer.load_checkpoint(args.resume, allow_other_bundle=args.allow_other_bundle)
        print(f"[run] resumed from {args.resume} (step {trainer.step_count})", file=sys.stderr)
    if args.seed is not None:
        trainer.seed = args.seed
    for text in args.lr_schedule:
        trainer.set_schedule(*named_schedule(text))
    for name, value in args.set_values:
        trainer.set_hyperparameter(name, value)
    return trainer


def _steps_per_call(args: RunConfig) -> int | Literal["auto"]:
    """``--steps-per-call``: K as given; none on the CPU, or an evaluation run, 1; else
    (``auto``, or none on an accelerator) "auto": the load measures the step and chooses
    (``runtime/auto_steps.py``)."""
    given = args.steps_per_call
    if isinstance(given, int):
        return given if args.entry == "train" else 1
    platform = args.device.partition(":")[0].lower()
    if args.entry != "train" or (given is None and platform == "cpu"):
        return 1
    return "auto"


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


def _layout_note(info: LoadInfo) -> str:
    """``layout fsdp+tp:2, mesh data 2 x model 2, 1.5 MiB of state per device``."""
    from .summary import nbytes

    mesh = " x ".join(f"{axis} {size}" for axis, size in info.mesh.items())
    return f"layout {info.layout}, mesh {mesh}, {nbytes(info.state_bytes_per_device)} of state per device"


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
        + (f" x{n_dev} ({_layout_note(trainer.load_info)})" if n_dev > 1 else "")
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
    if trainer.load_info.auto_steps:  # what steps_per_call="auto" chose, and why
        print(f"[{tag}] {trainer.load_info.auto_steps}", file=sys.stderr)
    report_origins(trainer, args, tag)


def _run_eval(args: RunConfig, trainer: Trainer, batches: Iterable[Any]) -> int:
    """One JSON line per batch of a read-only entry (it has no state, so no step offset),
    for ``--steps`` batches. A dataset's batches are read as they come: without
    ``--epochs`` they never end (this once read them all into a list first)."""
    writer = trainer.placement.writes_files
    source = itertools.cycle(batches) if isinstance(batches, list) else iter(batches)
    for i, batch in enumerate(itertools.islice(source, args.steps)):
        m = trainer.evaluate(batch, entry=args.entry)
        if writer:
            sys.stdout.write(
                json.dumps({"step": i, **{k: _scalar(v) for k, v in m.items()}}) + "\n"
            )
    return 0


def _run_train(
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
            _save_state(trainer, args.save_state)
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


def _save_state(trainer: Trainer, path: str) -> None:
    # A full checkpoint: --resume takes it, and PyTorch loads it back (load_into).
    trainer.save_checkpoint(path)  # every process takes part; process 0 writes
    if trainer.placement.writes_files:
        print(f"[run] wrote state to {path}", file=sys.stderr)
