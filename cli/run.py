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

from .common import die as _die
from .config import RunConfig
from .load_line import report_load
from .stopping import Signals
from .train_loop import run_train, save_state

if TYPE_CHECKING:
    from stepbundle.runtime import Trainer

    from .metrics_file import MetricsFile

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
                save_state(trainer, args.save_state)
            return 0
        return run_train(args, trainer, batches, steps, offset, metrics, signals)
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
    from .options import head_barriers, parallel_options, regather_weights
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
            regather_weights=regather_weights(args),
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
