"""A file appended to in whole records, written through, and cut back to its last whole
record when a write fails: what ``--metrics-file`` and ``--tensorboard`` write through,
so a full disk leaves valid files and a typed ``SinkError``, and a SIGKILL loses nothing
already written.

Imports: the standard library; ``stepbundle.schema.errors``, the runtime's data kinds.
"""

from __future__ import annotations

import contextlib
import errno
import os

from stepbundle.runtime.data.dataset_index import DataErrorKind
from stepbundle.schema.errors import DataError

__all__ = ["RecordFile", "SinkError", "close_sink", "sync_sink"]


class SinkError(DataError):
    """Writing a ``--metrics-file`` or ``--tensorboard`` sink failed (a full disk, a lost
    mount, a file removed under the run).

    The file was cut back to its last whole record before this was raised, so it stays
    valid. A ``DataError`` of kind ``WRITE_FAILED``: ``sink`` is the option
    (``"--metrics-file"``, ``"--tensorboard"``), ``path`` the file, ``error`` the
    ``OSError``.
    """

    def __init__(self, sink: str, path: str, error: OSError, doing: str) -> None:
        reason = f"{error.strerror or error} (errno {error.errno})" if error.errno else str(error)
        super().__init__(
            DataErrorKind.WRITE_FAILED,
            f"{sink}: cannot {doing} {path!r}: {reason}. The file was cut back to its last "
            "whole record and closed, and the run stops at the next step boundary, with a "
            "final checkpoint if it has a --checkpoint-dir. Free space (or fix the folder), "
            "then --resume from that checkpoint with the same options; the logs continue "
            "from there.",
            path=path,
        )
        self.sink = sink
        self.error = error


class RecordFile:
    """A file only ever appended to in whole records, written through (no buffer, no
    thread): a record is on the OS's side of the process when ``append`` returns, so a
    SIGKILL cannot lose it, and a failed write is known at once.

    A write that fails part way (``ENOSPC`` after a short write) is cut back with
    ``ftruncate`` to the end of the last whole record before the error is raised.
    """

    def __init__(self, path: str, *, exclusive: bool = False) -> None:
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        self.path = path
        self._fd: int | None = os.open(path, flags | (os.O_EXCL if exclusive else 0), 0o666)
        self.size = os.fstat(self._fd).st_size  # the end of the last whole record

    @property
    def fd(self) -> int:
        assert self._fd is not None, f"{self.path!r} is closed"
        return self._fd

    def append(self, data: bytes) -> None:
        view, done = memoryview(data), 0
        try:
            while done < len(data):
                n = os.write(self.fd, view[done:])
                if n <= 0:  # a regular file never does this; refuse to spin on it
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        except OSError:
            self.cut(self.size)
            raise
        self.size += len(data)

    def cut(self, size: int) -> None:
        """Cut the file back to ``size`` bytes (best effort: shrinking needs no space)."""
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, size)
        self.size = size

    def sync(self) -> None:
        """Put the file on the disk itself (a checkpoint's logs outlive a power cut)."""
        os.fsync(self.fd)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def sync_sink(file: RecordFile | None, sink: str, path: str) -> None:
    """``file.sync()`` for the sink ``sink`` (its option), a failure as ``SinkError``."""
    if file is not None:
        try:
            file.sync()
        except OSError as e:
            raise SinkError(sink, path, e, "sync") from None


def close_sink(file: RecordFile | None, sink: str, path: str) -> None:
    """``file.close()`` for the sink ``sink``, a failure as ``SinkError``; None: nothing."""
    if file is not None:
        try:
            file.close()
        except OSError as e:
            raise SinkError(sink, path, e, "close") from None
