"""The kinds of the paths a command is given, checked before anything is opened.

``check_path_kinds(args)`` refuses every input or output path that is not a regular
file (or, where a folder is taken, a folder): a named pipe or a device would block the
command for ever on its first open (``runtime/io/file_kinds.py``). It also refuses an
``http(s)://`` ``--checkpoint-dir`` or ``--save-state``: such URLs can only be read.
URLs and ``sha256:`` digests are not local paths and are left to the runtime.

``--metrics-file`` and ``--tensorboard`` are written as local files only: ``sink_path``
turns a ``file://`` URL into its path and refuses every other URL, and ``stepbundle run``
carries that path in its ``RunConfig`` from then on, so its checks and its writers use one
path.
(``https://../x.stepbundle`` was once checked as a URL, skipped, and then written as the
local path ``https:/../x.stepbundle``, which is ``../x.stepbundle``.)

Imports: the standard library, stepbundle.runtime's ``file_kinds``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stepbundle.schema.errors import UsageError

if TYPE_CHECKING:
    from .config import RunConfig

__all__ = ["check_path_kinds", "refuse_missing_resume", "resume_from_folder", "sink_path"]

# argument -> (its flag, a regular file taken, a folder taken)
_PATHS = {
    "bundle": ("the bundle", True, False),
    "source": ("the bundle", True, False),
    "data": ("--data", True, True),
    "eval_data": ("--eval-data", True, True),
    "resume": ("--resume", True, False),
    "init_from": ("--init-from", True, True),
    "metrics_file": ("--metrics-file", True, False),
    "save_state": ("--save-state", True, False),
    "checkpoint_dir": ("--checkpoint-dir", False, True),
    "tensorboard": ("--tensorboard", False, True),
}

_WRITTEN = ("checkpoint_dir", "save_state")
_SINKS = ("metrics_file", "tensorboard")


def sink_path(flag: str, given: str) -> str:
    """The local path a ``--metrics-file`` or ``--tensorboard`` argument names: itself,
    or the path of a ``file://`` URL.

    Raises:
      ValueError: any other URL (sinks append and sync as they go, which object stores
        and read-only http(s) cannot).
    """
    if "://" not in given:
        return given
    from stepbundle.runtime.io.remote import local_path

    local = local_path(given)
    if local is None:
        raise UsageError(
            f"{flag} {given!r} is a URL, but {flag} is written on the local disk, appended to "
            "and synced as the run goes (a file:// URL is taken as its path; no other URL "
            "is). Give a local path, and copy the output where it should go after the run."
        )
    return str(local)


def refuse_missing_resume(config: RunConfig) -> None:
    """Refuse a local ``--resume`` (a path, or a ``file://`` URL) that does not exist.

    Not an argparse type: in a multi-process job the command checks it after joining,
    so that the other processes hear of it (``stepbundle run``'s ``fail``) rather than
    wait for this one until the coordinator gives up.

    Raises:
      UsageError: nothing is there.
    """
    given = config.resume
    if not given or given.startswith("sha256:"):
        return
    local: str | Path | None = given
    if "://" in given:
        from stepbundle.runtime.io.remote import local_path

        local = local_path(given)  # file:// URLs only; others are read at load
    if local is not None and not Path(local).exists():
        raise UsageError(
            f"--resume {given!r} does not exist; give a checkpoint file (step-N.safetensors, "
            "or what --save-state wrote) or the --checkpoint-dir folder of an earlier run "
            "(its latest checkpoint is taken)."
        )


_CHECKPOINT_NAME = re.compile(r"step-\d{8,}\.safetensors")


def resume_from_folder(config: RunConfig) -> RunConfig:
    """``--resume DIR`` (a local checkpoint folder) means its latest checkpoint: of its
    ``step-N.safetensors`` files, the one whose metadata records the largest step, which
    the returned config resumes from (``config`` itself for any other ``--resume``). A checkpoint kept before a non-finite step
    (``step-N-before-nonfinite``) is taken only by name.

    The step is read from each file's metadata, not its name: another process once wrote
    ``--save-state ck/step-99999999.safetensors`` holding step 3, and its name won. A file
    whose name and recorded step differ is named on stderr; one whose metadata cannot be
    read is passed over, also named (a damaged file is refused when it is loaded by name).

    Raises:
      ValueError: the folder holds no readable checkpoint.
    """
    given = config.resume
    if not isinstance(given, str) or given.startswith("sha256:"):
        return config
    if "://" in given:
        from stepbundle.runtime.io.remote import local_path

        local = local_path(given)  # file:// URLs only; a bucket's folder is not listed
        if local is None:
            return config
        folder = Path(local)
    else:
        folder = Path(given)
    if not folder.is_dir():
        return config
    named = [p for p in folder.iterdir() if _CHECKPOINT_NAME.fullmatch(p.name) and p.is_file()]
    if not named:
        raise UsageError(
            f"--resume {given!r} is a folder holding no checkpoint (step-N.safetensors); "
            "give a checkpoint file, or the --checkpoint-dir of an earlier run."
        )
    ranked: list[tuple[int, bool, int, Path]] = []
    for path in named:
        by_name = int(path.name[5:].split(".")[0])
        try:
            step = _recorded_step(path)
        except ValueError as e:
            print(f"[run] --resume {given}: passing over {path.name}: {e}", file=sys.stderr)
            continue
        if step != by_name:
            print(
                f"[run] --resume {given}: {path.name} holds step {step}, not the step its "
                "name says; it is ranked by the step it holds",
                file=sys.stderr,
            )
        ranked.append((step, step == by_name, by_name, path))
    if not ranked:
        raise UsageError(
            f"--resume {given!r}: no checkpoint in that folder can be read (each is named "
            "above). Give a checkpoint file, or the --checkpoint-dir of an earlier run."
        )
    return dataclasses.replace(config, resume=str(max(ranked)[3]))


def _recorded_step(path: Path) -> int:
    """The step a checkpoint's metadata records (its header only is read).

    Raises:
      ValueError: the file is not a checkpoint whose metadata can be read.
    """
    from stepbundle.runtime.io.tensor_file import open_safetensors
    from stepbundle.schema.checkpoint_meta import parse_checkpoint_metadata
    from stepbundle.schema.errors import CheckpointError

    try:
        with open_safetensors(path) as f:
            return parse_checkpoint_metadata(path, f.metadata).step
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def check_path_kinds(args: argparse.Namespace | RunConfig) -> None:
    """Refuse, without opening anything, a path of ``args`` (a command's) of the wrong kind.

    Raises:
      ValueError: a path is a named pipe, a device or a socket (``NotARegularFileError``),
        an output is an http(s) URL, or a sink's is a URL other than file://.
    """
    from stepbundle.runtime.io.file_kinds import check_kind

    for name, (flag, file_ok, folder_ok) in _PATHS.items():
        value = getattr(args, name, None)
        if not isinstance(value, str) or not value or value.startswith("sha256:"):
            continue
        if name in _SINKS:
            value = sink_path(flag, value)
        scheme = value.split("://", 1)[0].lower() if "://" in value else ""
        if name in _WRITTEN and scheme in ("http", "https"):
            raise UsageError(
                f"{flag} {value!r} is an {scheme}:// URL, which can only be read: checkpoints "
                "need a writable local path or object-store URL (gs://, s3://, az://, ... with "
                "its fsspec backend installed). Give a local folder or a bucket."
            )
        if scheme and scheme != "file":
            continue
        check_kind(value.removeprefix("file://"), flag, file_ok=file_ok, folder_ok=folder_ok)
