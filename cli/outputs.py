"""Checks of ``stepbundle run``'s outputs, made before anything is loaded: nothing is
written over an input (``output_paths``) or over earlier checkpoints, and every output
can be written.

A checkpoint folder or ``--save-state`` at a URL is checked by listing it and writing
and removing a small probe object (credentials and scheme, before the run).

Imports: the standard library, stepbundle.schema; stepbundle.runtime's ``remote`` and
``store`` when an argument is a URL or a digest.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from stepbundle.schema.errors import UsageError

if TYPE_CHECKING:
    from .config import RunConfig

__all__ = ["check_outputs"]


def _check_writable_folder(folder: Path, what: str) -> None:
    """Create ``folder`` if needed and prove a file can be made in it, before any work."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OSError(f"{what}: cannot write into {str(folder)!r} ({e.strerror or e})") from None


def _refuse_locked(folder: Path, flag: str, given: str) -> None:
    """Refuse an output into a checkpoint folder another live run holds (its run lock,
    ``folder_lock``): a file written there, say ``--save-state ck/step-99999999.safetensors``,
    would be taken for one of that run's checkpoints."""
    from .folder_lock import LOCK_NAME, held_by_another_run

    holder = held_by_another_run(folder)
    if holder is not None:
        raise UsageError(
            f"{flag} {given!r} is in {str(folder)!r}, the checkpoint folder of a live run "
            f"({holder}, which holds {LOCK_NAME} there); what this run wrote there would "
            "be mixed with that run's checkpoints. Write it into another folder."
        )


def _local(location: str) -> Path | None:
    """The local path of a path or file:// URL; None for other URLs."""
    if "://" not in location:
        return Path(location)
    from stepbundle.runtime.io.remote import local_path

    return local_path(location)


def _check_bundle(args: RunConfig) -> RunConfig:
    """Refuse a bundle that cannot be opened. A ``sha256:<digest>`` is looked up in the
    store here, once (its entry verified in full, ``store.resolve_bundle``), and the run
    reads the file found from then on: the config returned has its ``bundle_file`` and
    ``bundle_digest``."""
    bundle: str = args.bundle
    if bundle.startswith("sha256:"):
        from stepbundle.runtime.io.store import resolve_bundle
        from stepbundle.schema.errors import StepbundleError

        try:
            found = resolve_bundle(bundle)  # a digest is only looked up: nothing is fetched
        except StepbundleError as e:  # not a digest, or not in the store
            raise UsageError(str(e)) from None
        return dataclasses.replace(
            args,
            bundle_file=os.fspath(found),
            bundle_digest="sha256:" + bundle.removeprefix("sha256:").lower(),
        )
    local = _local(bundle)
    if local is None:
        return args  # a URL: read at load time, through the bundle store
    try:
        os.stat(local)
    except OSError as e:
        raise UsageError(f"cannot open the bundle {bundle!r}: {e.strerror}.") from None
    return args


def _check_remote_folder(url: str, resume: str | None) -> None:
    """A checkpoint folder at a URL: no earlier checkpoints unless resuming, writable."""
    from stepbundle.runtime.io.remote import check_writable, join, list_names

    earlier = list_names(url, "step-*.safetensors")
    if earlier and not resume:
        raise UsageError(
            f"--checkpoint-dir {url!r} already holds checkpoints ({earlier[-1]} and "
            f"{len(earlier) - 1} more); a new run would overwrite them. Continue with "
            f"--resume {join(url, earlier[-1])}, or choose an empty folder."
        )
    check_writable(url)


def check_outputs(args: RunConfig) -> RunConfig:
    """Refuse, before anything is loaded, outputs that could not be written or that would
    overwrite an input or earlier checkpoints, and return the config the run goes on with.

    In it ``metrics_file`` and ``tensorboard`` are the local paths they name
    (``paths.sink_path``), which the checks and the run's writers then share; a bundle
    given as ``sha256:<digest>`` has its ``bundle_file``, its verified store entry, which
    the checks and the load then read (``_check_bundle``).
    """
    from .output_paths import check_output_paths
    from .paths import sink_path
    from .sinks import check_sink_outputs

    # The sinks' local paths, once: every check below and the writers use these.
    args = dataclasses.replace(
        args,
        metrics_file=(
            sink_path("--metrics-file", args.metrics_file)
            if args.metrics_file
            else args.metrics_file
        ),
        tensorboard=(
            sink_path("--tensorboard", args.tensorboard) if args.tensorboard else args.tensorboard
        ),
    )
    args = _check_bundle(args)
    check_output_paths(args)  # before anything below creates an output
    check_sink_outputs(args.metrics_file, args.tensorboard)  # a folder, a missing folder
    if args.metrics_file:
        _refuse_locked(Path(args.metrics_file).parent, "--metrics-file", args.metrics_file)
    if args.tensorboard:
        _refuse_locked(Path(args.tensorboard), "--tensorboard", args.tensorboard)
    if args.metrics_file:
        from stepbundle.schema.errors import StepbundleError

        from .metrics_file import check_metrics_file

        try:
            # Read only: rows of ours, or none; and none for a run that starts at step 0.
            fresh = args.entry == "train" and not args.resume
            check_metrics_file(args.metrics_file, fresh=fresh)
        except StepbundleError as e:
            raise UsageError(str(e)) from None
    if args.checkpoint_every and not args.checkpoint_dir:
        raise UsageError(
            "--checkpoint-every writes checkpoints into --checkpoint-dir, which is missing: "
            "add --checkpoint-dir DIR."
        )
    if args.check_state and not args.stop_on_nonfinite:
        raise UsageError(
            "--check-state works with --stop-on-nonfinite (the state can only be kept when "
            "steps do not donate it): add --stop-on-nonfinite."
        )
    if args.eval_every and not args.eval_data:
        raise UsageError("--eval-every evaluates --eval-data, which is missing: add it.")
    k = args.steps_per_call if isinstance(args.steps_per_call, int) else 1
    # auto (runtime/auto_steps.py) is given the cadences, and keeps to them
    for flag, every in (
        ("--checkpoint-every", args.checkpoint_every),
        ("--eval-every", args.eval_every),
    ):
        if every and k > 1 and every % k:
            lower = max(k, every - every % k)
            raise UsageError(
                f"{flag} {every} is not a multiple of --steps-per-call {k}: the state moves {k} "
                f"steps per call, so it is only there to save or evaluate between calls. Use "
                f"{flag} {lower} or {lower + k}."
            )
    if args.entry != "train" and args.steps is None:
        raise UsageError(f"--entry {args.entry} runs --steps batches: give --steps.")
    dataset_only = ("batch_size", "epochs")
    if not Path(args.data).is_dir():
        given = [f"--{k.replace('_', '-')}" for k in dataset_only if getattr(args, k)]
        if given or args.no_shuffle or args.last_batch != "drop":
            raise UsageError(
                f"{', '.join(given) or 'the shuffling and last-batch options'} apply to a "
                f"dataset folder, but --data {args.data!r} is an .npz."
            )
    save_state = _local(args.save_state) if args.save_state else None
    if args.save_state and save_state is None:
        from stepbundle.runtime.io.remote import check_writable

        check_writable(args.save_state.rpartition("/")[0])
    if save_state is not None and args.save_state:
        target = save_state
        if target.is_dir():
            raise UsageError(f"--save-state {args.save_state!r} is a folder; give a file name.")
        parent = target.parent if str(target.parent) else Path(".")
        _refuse_locked(parent, "--save-state", args.save_state)
        _check_writable_folder(parent, "--save-state")
    folder = _local(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.checkpoint_dir and folder is None:
        _check_remote_folder(args.checkpoint_dir, args.resume)
    if folder is not None:
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file, not a folder.")
        earlier = sorted(folder.glob("step-*.safetensors")) if folder.is_dir() else []
        if earlier and not args.resume:
            raise UsageError(
                f"--checkpoint-dir {args.checkpoint_dir!r} already holds checkpoints "
                f"({earlier[-1].name} and {len(earlier) - 1} more); a new run would overwrite "
                f"them. Continue with --resume {args.checkpoint_dir} (its latest checkpoint), "
                "or choose an empty folder."
            )
        # Temp files killed writers left are removed once the folder's lock is held
        # (folder_lock), not here: a run refused for a live holder must touch nothing.
        _check_writable_folder(folder, "--checkpoint-dir")
    return args
