"""Refuse a path that is neither a regular file nor a folder (a named pipe, a device, a
socket), by looking at it without opening it.

Opening a named pipe (FIFO) for reading waits for a writer, and for writing waits for a
reader: given as ``--data``, ``--resume`` or ``--metrics-file`` it blocked a run for
ever before any message. A character device (``/dev/zero``) reads without end, and a
socket cannot be opened at all. ``os.stat`` follows symbolic links and never opens the
file, so ``check_kind`` sees what the path leads to and cannot block.

Imports: the standard library, stepbundle.schema.
"""

from __future__ import annotations

import os
import stat

from stepbundle.schema.errors import UsageError

__all__ = ["NotARegularFileError", "check_kind", "kind_of"]


class NotARegularFileError(UsageError):
    """A path given as an input or output is a named pipe, a device or a socket."""


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a named pipe (FIFO)"``)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"  # pragma: no cover - doors, whiteouts


def check_kind(
    path: str | os.PathLike[str], what: str, *, file_ok: bool = True, folder_ok: bool = False
) -> None:
    """Refuse ``path`` if it is neither missing, a regular file nor a folder: a named
    pipe, a device or a socket. ``what`` names it in the message (``"--data"``), and
    ``file_ok`` and ``folder_ok`` say what it should be. Never opens it.

    A folder where a file is wanted (or the other way round) passes: its caller refuses
    it in its own words ("--save-state ... is a folder; give a file name").

    Raises:
      NotARegularFileError: it is a FIFO, a device, a socket, ...
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing or unreadable: the caller's own checks say so
        return
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    wanted = " or ".join(
        w for w, ok in (("a regular file", file_ok), ("a folder", folder_ok)) if ok
    )
    if stat.S_ISFIFO(mode):
        blocks = " (opening it waits for another process, for ever if none comes)"
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        blocks = " (a device is no file of ours, and may read without end)"
    else:
        blocks = ""
    raise NotARegularFileError(
        f"{what} {os.fspath(path)!r} is {kind_of(mode)}, not {wanted}{blocks}. Give "
        f"{wanted} (write the data to a file first if it comes from a pipe)."
    )
