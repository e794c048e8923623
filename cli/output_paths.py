"""Where ``stepbundle run`` writes, against what it reads, checked before anything is
loaded: no output is an input or lies in an input's folder, two outputs do not share a
file, and no output goes to a file system that lives only in this process.

The outputs are ``--metrics-file``, ``--save-state`` (files), ``--checkpoint-dir`` and
``--tensorboard`` (folders); the inputs are the bundle, ``--data``, ``--eval-data``,
``--resume`` and ``--init-from``, each a file or a folder (a dataset, a save_pretrained
folder; a ``model.safetensors.index.json`` stands for the folder of its shards). Paths
are compared resolved (links followed), and an existing output file also by device and
inode, so a hard link to an input is that input. An input inside an output folder is
fine: ``--resume ck/step-100.safetensors --checkpoint-dir ck`` is how a run continues.

Imports: the standard library; this package's ``paths``; stepbundle.runtime's ``remote``
and ``store`` when an argument is a URL or a digest.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepbundle.schema.errors import UsageError

from .paths import sink_path

if TYPE_CHECKING:
    from .config import RunConfig

__all__ = ["check_output_paths"]

# Files listed per input folder when looking for hard links to them; a dataset's
# shards are the files of its folder itself.
_MAX_LISTED = 100_000


@dataclass(frozen=True)
class _Place:
    """One input or output of the run, on the local file system.

    Attributes:
      flag: how messages name it: ``--data``, ``the bundle``.
      given: the argument as given.
      path: the resolved local path.
      folder: whether the run reads or writes what is inside it (rather than the file).
    """

    flag: str
    given: str
    path: Path
    folder: bool


def _local(location: str) -> Path | None:
    """The resolved local path of a path or file:// URL; None for other URLs."""
    if "://" in location:
        from stepbundle.runtime.io.remote import local_path

        found = local_path(location)
        return None if found is None else found.resolve()
    return Path(location).resolve()


def _inputs(args: RunConfig) -> list[_Place]:
    places = []
    # A digest's store entry, found and verified once by check_outputs (bundle_file).
    bundle: str = args.bundle_file or args.bundle
    if bundle.startswith("sha256:"):
        from stepbundle.runtime.io.store import resolve_bundle

        bundle = os.fspath(resolve_bundle(bundle))
    for flag, given in (
        ("the bundle", bundle),
        ("--data", args.data),
        ("--eval-data", args.eval_data),
        ("--resume", args.resume),
        ("--init-from", args.init_from),
    ):
        if not given:
            continue
        path = _local(given)
        if path is None:
            continue
        if path.name.endswith(".index.json"):  # sharded: the shards lie beside it
            places.append(_Place(flag, given, path, False))
            path = path.parent
        places.append(_Place(flag, given, path, path.is_dir()))
    return places


def _outputs(args: RunConfig) -> list[_Place]:
    places = []
    for flag, given, folder in (
        ("--metrics-file", args.metrics_file, False),
        ("--save-state", args.save_state, False),
        ("--checkpoint-dir", args.checkpoint_dir, True),
        ("--tensorboard", args.tensorboard, True),
    ):
        if not given:
            continue
        if flag in ("--metrics-file", "--tensorboard"):
            given = sink_path(flag, given)  # local only: the path the sink writes
        _refuse_process_local(flag, given)
        path = _local(given)
        if path is not None:
            places.append(_Place(flag, given, path, folder))
    return places


def _refuse_process_local(flag: str, given: str) -> None:
    """Refuse an fsspec file system that lives only in this process (``memory://``, or
    a cache or folder view over it): a run would report success and keep nothing."""
    if "://" not in given or given.startswith("file://"):
        return
    from fsspec.implementations.memory import MemoryFileSystem

    from stepbundle.runtime.io.remote import filesystem

    fs: Any = filesystem(given)[0]
    while fs is not None:  # chained URLs wrap their target in ``.fs``
        if isinstance(fs, MemoryFileSystem):
            raise UsageError(
                f"{flag} {given!r} is on fsspec's memory file system, which keeps files only "
                "in this process's memory: they would be gone when the run ends. Give a "
                "real folder or URL, e.g. runs/a/ or gs://bucket/runs/a/."
            )
        fs = getattr(fs, "fs", None)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _files_of(place: _Place) -> dict[tuple[int, int], Path]:
    """Device and inode of the input's file, or of every file directly in its folder."""
    if not place.folder:
        key = _identity(place.path)
        return {} if key is None else {key: place.path}
    found: dict[tuple[int, int], Path] = {}
    try:
        listed = list(itertools.islice(place.path.iterdir(), _MAX_LISTED))
    except OSError:
        return found
    for p in listed:
        key = _identity(p)
        if key is not None and p.is_file():
            found.setdefault(key, p)
    return found


def _clash(out: _Place, source: _Place) -> str | None:
    """Why writing ``out`` would change the input ``source``; None if it would not."""
    if out.path == source.path:
        return (
            f"{out.flag} {out.given!r} is {source.flag}; writing it would destroy an input. "
            f"Choose another {'folder' if out.folder else 'file'}."
        )
    if source.folder and out.path.is_relative_to(source.path):
        return (
            f"{out.flag} {out.given!r} lies in the folder of {source.flag} {source.given!r}, "
            "which the run reads; writing there would change an input. Choose a path outside "
            "that folder."
        )
    key = None if out.folder else _identity(out.path)
    linked = _files_of(source).get(key) if key is not None else None
    if linked is not None:
        what = source.flag if linked == source.path else f"{linked}, a file of {source.flag}"
        return (
            f"{out.flag} {out.given!r} is a link to {what}; writing it would destroy an "
            "input. Choose another file."
        )
    return None


def check_output_paths(args: RunConfig) -> None:
    """Refuse an output that is an input, lies in an input's folder, shares a file with
    another output, or is kept only in this process's memory.

    Raises:
      ValueError: the first such output, in a sentence that says what to do.
    """
    outputs = _outputs(args)
    inputs = _inputs(args)
    for out in outputs:
        for source in inputs:
            why = _clash(out, source)
            if why is not None:
                raise UsageError(why)
    for i, out in enumerate(outputs):
        for other in outputs[i + 1 :]:
            if out.path == other.path:
                raise UsageError(
                    f"{out.flag} {out.given!r} is also {other.flag}; two outputs cannot share "
                    f"one {'folder' if out.folder else 'file'}. Choose another path for one "
                    "of them."
                )
