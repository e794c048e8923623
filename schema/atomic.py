"""The project's one atomic file write: a reader sees the old file or the new one, never part.

``atomic_write`` writes to a temporary file in the target's own folder (so the rename
never crosses file systems), flushes it to disk, renames it onto the target with
``os.replace`` and flushes the folder, so the rename itself survives a power cut. On any
error, or an interruption, the temporary file is removed and the target is untouched.

The new file gets the permissions a plain ``open(path, "w")`` would give it (``0o666``
less the umask), not the ``0o600`` of ``tempfile.mkstemp``: the temporary file is created
with ``os.open(..., 0o666)``, and the kernel applies the umask (or the folder's default
ACL) itself. Reading the umask to compute the bits would mean setting it for a moment,
which is not thread-safe. ``mode`` sets the bits explicitly instead.

The temporary file is opened with ``os.open`` and wrapped with ``os.fdopen``; crash tests
stop a writer by patching those.

Imports: standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterable
from typing import BinaryIO

__all__ = ["Chunks", "WriteFn", "atomic_write", "fsync_directory", "temp_files"]

WriteFn = Callable[[BinaryIO], object]
"""A function that writes the whole content to the binary file it is given."""

Chunks = Iterable[bytes | bytearray | memoryview]
"""The content as byte chunks, written in order."""

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)


def atomic_write(
    path: str | os.PathLike[str],
    content: WriteFn | Chunks,
    *,
    mode: int | None = None,
    check: Callable[[str], object] | None = None,
) -> None:
    """Replace ``path`` with new content, atomically and durably.

    Args:
      path: the file to write; its folder must exist.
      content: either a function that writes to the binary file it is handed (it need not
        flush or close it), or an iterable of byte chunks (``bytes`` is not accepted as a
        chunk iterable: pass ``[data]``).
      mode: permission bits of the new file; ``None`` gives ``0o666`` less the umask.
      check: called with the temporary file's path once it is complete and on disk, just
        before the rename; whatever it raises stops the write (the content is refused:
        nothing is renamed, the temporary file is removed).

    Raises:
      OSError: the file could not be written; ``path`` is untouched.
      Whatever ``content`` raises, after the temporary file is removed.
    """
    if isinstance(content, bytes | bytearray | memoryview):
        raise TypeError(
            "atomic_write takes a write function or an iterable of byte chunks, not bytes "
            "itself (which would be written one integer at a time); pass [data]."
        )
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    temp = os.path.join(
        directory,
        f".{os.path.basename(target)}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}",
    )
    fd = os.open(temp, _FLAGS, 0o666)
    try:
        try:
            f = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            raise
        with f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            if callable(content):
                content(f)
            else:
                for chunk in content:
                    f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            check(temp)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_directory(directory)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Flush a folder's entries to disk, so that a rename in it survives a power cut.

    Does nothing where folders cannot be opened or flushed (Windows, some file systems).
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:  # pragma: no cover - platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems without directory fsync
        pass
    finally:
        os.close(fd)


# Temp names carry the host and process id, for a person reading a folder listing. They
# do not tell a live writer from a dead one: a process id means nothing across PID
# namespaces (containers that share a folder, and often a host name), so a live writer's
# file once looked dead and was removed under it (``temp_files``).
_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"
_TEMP_NAME = re.compile(
    r"\.(?P<name>.+)\.tmp-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>[0-9]+)-[0-9a-f]{8}\Z"
)
# The temp files of mkstemp-based writers before 2026-12-01: ".<name>.<random>.tmp".
_LEGACY_TEMP_NAME = re.compile(r"\..+\.[A-Za-z0-9_]{8}\.tmp\Z")
LEGACY_MIN_AGE_S = 3600.0


def temp_files(directory: str | os.PathLike[str], *, min_age_s: float = 0.0) -> list[str]:
    """The temp files ``atomic_write`` writes in ``directory`` that were last changed at
    least ``min_age_s`` seconds ago, sorted.

    Nothing here tells a live writer's file from one a killed writer left: the caller
    decides. One that holds the folder's lock, so that no writer is live there, takes
    them all (``min_age_s=0``); one without a lock takes only files older than any live
    write leaves them (a writer changes its file as it writes). Temp files of the older
    naming (``.<name>.<random>.tmp``, no host or process) are listed only once they are
    ``LEGACY_MIN_AGE_S`` old, whatever ``min_age_s`` is: an older stepbundle, which
    takes no lock, may still be writing one.
    """
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    now = time.time()
    for entry in names:
        if _TEMP_NAME.fullmatch(entry):
            age = min_age_s
        elif _LEGACY_TEMP_NAME.fullmatch(entry):
            age = max(min_age_s, LEGACY_MIN_AGE_S)
        else:
            continue
        path = os.path.join(directory, entry)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime >= age:
                found.append(path)
    return sorted(found)
