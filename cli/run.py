"""``stepbundle run``: run a bundle's steps in a lean process (no torch).

Imports: the runtime (lazily, so ``--help`` stays fast), numpy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .common import EXIT_PIPE_CLOSED
from .common import die as _die

__all__ = ["cmd_run"]


# ---------------------------------------------------------------------- run
def _scalar(v: Any) -> Any:
    """One metric for a JSON line: a float, or a list of floats for a metric with several
    elements; non-finite values as the strings "NaN", "Infinity", "-Infinity"."""
    from stepbundle.runtime.metrics import to_json_floats

    return to_json_floats({"value": v})["value"]


def _join_job(args: argparse.Namespace) -> bool:
    """Set up devices before jax starts: virtual CPU devices, and the multi-process job.

    Returns whether this process joined a multi-process job.
    """
    from stepbundle.runtime import distributed

    multi = args.distributed or args.coordinator is not None
    if not multi and (args.num_processes is not None or args.process_id is not None):
        raise ValueError("--num-processes and --process-id need --coordinator HOST:PORT")
    cpu_devices = None
    platform = args.device.partition(":")[0].lower()
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if platform == "cpu" and isinstance(args.devices, int) and args.devices > 1 and not forced:
        processes = args.num_processes or 1
        cpu_devices = -(-args.devices // processes)
    if multi and args.devices == 1:
        raise ValueError(
            "A multi-process job runs one data-parallel program over its devices: pass "
            "--devices all (or a number that covers every process's devices)."
        )
    if multi:
        distributed.initialize(
            args.coordinator, args.num_processes, args.process_id, cpu_devices=cpu_devices
        )
    elif cpu_devices is not None:
        distributed.set_cpu_devices(cpu_devices)
    return multi


# How long the processes of a job wait for each other to load (cold compiles included).
_SETUP_TIMEOUT_S = 1800.0


def cmd_run(args: argparse.Namespace) -> int:
    from stepbundle.runtime import distributed
    from stepbundle.runtime.batches import iter_batches
    from stepbundle.schema.errors import BundleError

    try:
        _check_outputs(args)
    except (OSError, ValueError) as e:
        return _die(str(e), 2)
    try:
        joined = _join_job(args)
    except (BundleError, ValueError) as e:
        return _die(str(e), 1)

    def fail(message: str, code: int) -> int:
        # In a job, tell the other processes, which would otherwise wait for this one
        # in their first step.
        if joined:
            with contextlib.suppress(BundleError):
                distributed.agree(False, timeout_s=_SETUP_TIMEOUT_S)
        return _die(message, code)

    try:
        data = _read_data(args.data)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        return fail(f"cannot read --data {args.data!r}: {e}", 2)
    try:
        t0 = time.perf_counter()
        trainer = _open_trainer(args)
        load_s = time.perf_counter() - t0
        batches = iter_batches(data)
    except (BundleError, ValueError) as e:
        return fail(str(e), 1)
    try:
        if joined and not distributed.agree(True, timeout_s=_SETUP_TIMEOUT_S):
            return _die("another process of the job failed to start; its error says why", 1)
    except BundleError as e:
        return _die(str(e), 1)
    _report_load(args, trainer, load_s)
    if args.checkpoint_every and not args.checkpoint_dir:
        return _die("--checkpoint-every needs --checkpoint-dir")
    try:
        if args.entry != "train":
            return _run_eval(args, trainer, batches)
        return _run_train(args, trainer, batches)
    except BundleError as e:
        return _die(str(e), 1)


_NPY_HEADER_READERS: dict[tuple[int, int], Any] = {}


def _read_data(path: str) -> dict[str, Any]:
    """Read an ``.npz`` of stacked batches, refusing what is not one before reading it.

    Every member's header is read first and its declared size compared with what the
    archive holds, so a damaged or hostile header is an error, not a huge allocation.
    """
    import numpy as np

    Path(path).stat()  # a missing file is "no such file", not "not an archive"
    _NPY_HEADER_READERS.setdefault((1, 0), np.lib.format.read_array_header_1_0)
    _NPY_HEADER_READERS.setdefault((2, 0), np.lib.format.read_array_header_2_0)
    if not zipfile.is_zipfile(path):
        raise ValueError(
            "it is not an .npz archive (write one with numpy.savez(path, x=xs, y=ys), one "
            "(S, *batch shape) array per batch input)"
        )
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = _NPY_HEADER_READERS.get(version)
                if read_header is None:  # format 3.0 (utf-8 names): np.load checks it
                    continue
                shape, _, dtype = read_header(member)
                if dtype.hasobject:
                    raise ValueError(f"{info.filename} holds Python objects, not numbers")
                declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if declared > info.file_size:
                    raise ValueError(
                        f"{info.filename} declares {shape} {dtype} ({declared} bytes) but the "
                        f"archive holds {info.file_size} bytes for it: the file is damaged"
                    )
    with np.load(path, allow_pickle=False) as npz:
        data = {k: npz[k] for k in npz.files}
    if not data:
        raise ValueError("it holds no arrays")
    if any(a.ndim >= 1 and a.shape[0] == 0 for a in data.values()):
        raise ValueError("it holds 0 batches (every array's first dimension is the batch count)")
    return data


def _open_trainer(args: argparse.Namespace) -> Any:
    """Load the bundle, then restore ``--resume`` and apply ``--seed``, schedules and ``--set``."""
    from stepbundle.runtime import load
    from stepbundle.runtime.schedule import parse_schedule

    trainer = load(
        args.bundle,
        device=args.device,
        # An evaluation run compiles only its entry (the training buckets need not
        # split over the devices then).
        entry=None if args.entry == "train" else args.entry,
        cache_dir=False if args.no_cache else (args.cache_dir or True),
        expect_digest=args.expect_digest,
        stop_on_nonfinite=args.stop_on_nonfinite,
        devices=args.devices,
        pack_state=args.pack_state,
        shard_optimizer_state=args.shard_optimizer_state,
    )
    if args.resume:
        trainer.load_checkpoint(args.resume, allow_other_bundle=args.allow_other_bundle)
    if args.seed is not None:
        trainer.seed = args.seed
    for spec in args.lr_schedule or []:
        name, _, rest = spec.partition("=") if "=" in spec.split(":", 1)[0] else ("lr", "", spec)
        trainer.set_schedule(name, parse_schedule(rest))
    for name, value in args.set or []:
        trainer.set_hyperparameter(name, value)
    return trainer


def _report_load(args: argparse.Namespace, trainer: Any, load_s: float) -> None:
    n_dev = len(trainer.devices)
    print(
        f"[run] loaded {args.bundle} in {load_s:.2f}s ({trainer.load_info.compiled} compiled, "
        f"{trainer.load_info.cache_hits} from cache) on {args.device}"
        + (f" x{n_dev} (data parallel)" if n_dev > 1 else ""),
        file=sys.stderr,
    )


def _run_eval(args: argparse.Namespace, trainer: Any, batches: list[Any]) -> int:
    """One JSON line per batch of a read-only entry (it has no state, so no step offset)."""
    writer = trainer.placement.writes_files
    for i in range(args.steps):
        m = trainer.evaluate(batches[i % len(batches)], entry=args.entry)
        if writer:
            sys.stdout.write(
                json.dumps({"step": i, **{k: _scalar(v) for k, v in m.items()}}) + "\n"
            )
    return 0


class _StopRequested(Exception):
    """Raised from the step callback to end a run at a step boundary."""


class _Stopper:
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
    def installed(self, enabled: bool) -> Iterator[_Stopper]:
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
            raise _StopRequested(self.reason)


def _run_train(args: argparse.Namespace, trainer: Any, batches: list[Any]) -> int:
    from stepbundle.runtime.errors import NonFiniteLossError

    from .report import Reporter

    start_step = trainer.step_count
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    stdout = sys.stdout
    stopper = _Stopper()

    # In a multi-process job process 0 reports; every process computes.
    reporter = Reporter(
        first_step=start_step,
        steps=args.steps,
        json_lines=args.json,
        log_every=args.log_every,
        metrics_file=args.metrics_file,
        tensorboard=args.tensorboard,
        writes_files=trainer.placement.writes_files,
        hyperparameters=lambda: trainer.hyperparameters,
        stdout=stdout,
        stderr=sys.stderr,
    )

    def on_step(i: int, metrics: dict[str, Any]) -> None:
        step = start_step + i
        last = i + 1 == args.steps or stopper.exit_code is not None
        try:
            reporter.step(i, step, metrics, last=last)
        except BrokenPipeError:
            stopper.request(EXIT_PIPE_CLOSED, "stdout was closed")
        if stopper.exit_code is not None:
            reporter.close()  # end the bar's line before the stop is reported
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            assert ckpt_dir is not None
            trainer.save_checkpoint(ckpt_dir / f"step-{step + 1:08d}.safetensors")
        stopper.check()

    t1 = time.perf_counter()
    code = 0
    # Signals stop a single-process run cleanly. A multi-process job keeps the default:
    # its processes cannot agree on one step boundary without a collective per step.
    with stopper.installed(enabled=len({d.process_index for d in trainer.devices}) == 1), reporter:
        try:
            trainer.run(batches, args.steps, on_step=on_step, offset=start_step, keep_metrics=False)
        except NonFiniteLossError as e:
            reporter.close()
            print(f"\n[run] {e}", file=sys.stderr)
            if ckpt_dir is not None:
                trainer.save_checkpoint(
                    ckpt_dir / f"step-{trainer.step_count:08d}-before-nonfinite.safetensors"
                )
            code = 3
        except _StopRequested as stop:
            code = stopper.exit_code or 1
            print(f"\n[run] stopping after step {trainer.step_count} ({stop})", file=sys.stderr)
            if ckpt_dir is not None:
                final = ckpt_dir / f"step-{trainer.step_count:08d}.safetensors"
                trainer.save_checkpoint(final)
                print(f"[run] wrote checkpoint {final}", file=sys.stderr)
        trainer.block_until_ready()
    elapsed = time.perf_counter() - t1
    done = trainer.step_count - start_step
    print(
        f"[run] {done} steps in {elapsed:.2f}s ({done / max(elapsed, 1e-9):.1f} steps/s)",
        file=sys.stderr,
    )
    if args.save_state:
        _save_state(trainer, args.save_state)
    return code


def _save_state(trainer: Any, path: str) -> None:
    # A full checkpoint: --resume takes it, and PyTorch loads it back (load_into).
    trainer.save_checkpoint(path)  # every process takes part; process 0 writes
    if trainer.placement.writes_files:
        print(f"[run] wrote state to {path}", file=sys.stderr)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_writable_folder(folder: Path, what: str) -> None:
    """Create ``folder`` if needed and prove a file can be made in it, before any work."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OSError(f"{what}: cannot write into {str(folder)!r} ({e.strerror or e})") from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before anything is loaded, outputs that could not be written or that would
    overwrite an input or earlier checkpoints."""
    from stepbundle.schema.atomic import stale_temp_files

    from .sinks import check_sink_outputs

    check_sink_outputs(args.metrics_file, args.tensorboard)
    if args.save_state:
        target = Path(args.save_state)
        for name, source in (("the bundle", args.bundle), ("--data", args.data)):
            if _same_file(args.save_state, source):
                raise ValueError(
                    f"--save-state {args.save_state!r} is {name}; writing it would destroy an "
                    "input. Choose another file."
                )
        if target.is_dir():
            raise ValueError(f"--save-state {args.save_state!r} is a folder; give a file name.")
        _check_writable_folder(target.parent if str(target.parent) else Path("."), "--save-state")
    if args.checkpoint_dir:
        folder = Path(args.checkpoint_dir)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file, not a folder.")
        earlier = sorted(folder.glob("step-*.safetensors")) if folder.is_dir() else []
        if earlier and not args.resume:
            raise ValueError(
                f"--checkpoint-dir {args.checkpoint_dir!r} already holds checkpoints "
                f"({earlier[-1].name} and {len(earlier) - 1} more); a new run would overwrite "
                f"them. Continue with --resume {earlier[-1]}, or choose an empty folder."
            )
        _check_writable_folder(folder, "--checkpoint-dir")
        for stale in stale_temp_files(folder):  # left by a killed writer
            with contextlib.suppress(OSError):
                os.unlink(stale)
                print(f"[run] removed {stale}, left by an interrupted write", file=sys.stderr)
