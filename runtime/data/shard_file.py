"""One shard file of a dataset (or a token stream's file, ``tokens.py``), read so that a
file shrinking under its reader is a ``DataError``, never a SIGBUS.

A memory-mapped file that another process truncates makes every read of the lost pages
raise SIGBUS, which kills the reader: no exception, no final checkpoint. Comparing the
file's size before each read (what the dataset reader did until 2026-12) leaves the
microseconds between the check and the read, and a loaded CI machine landed a truncation
in them. So a shard file is read one of two ways, chosen when the dataset is opened:

- **Leased and memory-mapped** (Linux, the usual case). The file is opened read-only and
  given a read lease (``fcntl(F_SETLEASE, F_RDLCK)``). While the lease is held, another
  process's ``truncate`` or ``open`` for writing of the file waits in the kernel until
  the lease is let go (or until ``/proc/sys/fs/lease-break-time`` passes, 45 s by
  default). Each read first asks whether the lease still holds (one
  ``fcntl(F_GETLEASE)``, ~0.8 us, cheaper than the ``fstat`` it replaced) and then takes
  the rows straight from the memory map: no process can shrink the file between the
  question and the read. When the answer is that the lease is being broken, the reader
  lets it go at once (the writer goes on) and reads the file with ``pread`` from then on.
- **pread** (everything else: the lease was refused, as for another user's file without
  ``CAP_LEASE``, a file system without leases such as NFS or FUSE, or a file some
  process held open for writing when the dataset was opened; and on other systems than
  Linux). The rows are read with ``os.preadv`` straight into the batch, one call per run
  of adjacent rows: a read past the end of a truncated file comes back short, it cannot
  fault. Slower for a shuffled batch of small rows (one system call per row); an
  in-order read is one call per shard.

On the pread path the file's size is compared with the opened one before each read, and
a short read is refused too: either is ``DataError`` (``WRONG_SIZE``). Where ``os.preadv``
does not exist (Windows) the file is mapped unguarded: Windows refuses to shrink a file
while a view of it is mapped.

The lease's signal: the kernel tells a lease's owner that it is being broken with a
signal (``SIGIO`` by default, whose default action ends the process). The owner is
cleared (``F_SETOWN 0``) just after the lease is taken, so no signal is ever sent; in the
microsecond between the two the signal would be ``F_SETSIG``'s ``SIGURG``, which a
process ignores by default.

A cost of the lease: while a ``Dataset`` is open and idle, a process writing one of its
shard files in place (``numpy.save`` over it) waits until the dataset next reads or is
closed (``Dataset.close``, or garbage collected), at most the lease-break time. A
process that does so to a dataset it holds open itself waits the whole 45 s. stepbundle's
writers never write in place (a new file is renamed over the old, which breaks no lease).

Imports: numpy, the standard library, ``stepbundle.schema.errors`` (and this package's
``dataset_index``).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import signal
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.schema.errors import UsageError

from .dataset_index import DataError, DataErrorKind, data_error

__all__ = ["ShardFile", "open_shard_file", "read_npy_header"]

_PREADV = hasattr(os, "preadv")
# The mapping needs no descriptor of its own (its size is never asked): one descriptor
# per shard instead of two. Remove the condition once requires-python is >= 3.13.
_NO_FD_COPY: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
if sys.platform == "linux":
    import fcntl

    _fcntl = fcntl.fcntl
    _SETLEASE, _GETLEASE, _SETSIG = fcntl.F_SETLEASE, fcntl.F_GETLEASE, fcntl.F_SETSIG
    _RDLCK, _UNLCK, _SETOWN = fcntl.F_RDLCK, fcntl.F_UNLCK, fcntl.F_SETOWN


def _take_lease(fd: int) -> bool:
    """Whether a read lease on ``fd`` is now held, with no signal to be sent on its break."""
    if sys.platform != "linux":
        return False
    try:
        _fcntl(fd, _SETSIG, signal.SIGURG)
        _fcntl(fd, _SETLEASE, _RDLCK)
    except OSError:  # EACCES (not the owner), EAGAIN (open for writing), EINVAL (the fs)
        return False
    try:
        _fcntl(fd, _SETOWN, 0)
    except OSError:
        _let_lease_go(fd)
        return False
    return True


def _let_lease_go(fd: int) -> None:
    # OSError: already broken (the kernel's timeout), or the fd is closed.
    with contextlib.suppress(OSError):
        _fcntl(fd, _SETLEASE, _UNLCK)


class ShardFile:
    """One shard file opened read-only, and the way its rows are read (module docstring).

    Attributes:
      path: the file.
      size: its size in bytes when the dataset was opened (checked against the header).
      offset: where its rows start (the ``.npy`` header's length).
      row_bytes: the bytes of one row.
    """

    def __init__(
        self,
        path: str,
        fd: int,
        size: int,
        offset: int,
        row_bytes: int,
        mapped: np.ndarray[Any, Any] | None,
        leased: bool,
    ) -> None:
        self.path = path
        self.size = size
        self.offset = offset
        self.row_bytes = row_bytes
        self._fd = fd
        # The rows as an array that cannot fault while the lease holds (or at all when
        # there is no lease: rows in memory, or Windows); None: read with pread.
        self._mapped = mapped
        self._leased = leased
        self._guarded = leased  # never changes: the mapping is read only under the lock
        self._closed = False
        # Held from the lease's check to the end of a read, through a pread, and to let
        # the lease go or close: numpy's take lets other threads run, and one letting the
        # lease go under another's read would let the file shrink under it.
        self._lock = threading.Lock()
        self._close_fd = weakref.finalize(self, os.close, fd) if fd >= 0 else None

    def __repr__(self) -> str:
        return f"ShardFile({self.path!r}, {'mapped' if self.mapped else 'pread'})"

    @property
    def mapped(self) -> bool:
        """Whether rows are read from the memory map (a lease held, or nothing to
        guard) rather than with pread."""
        return self._mapped is not None

    def read(self, rows: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
        """Copy this shard's rows ``rows`` (int64 row numbers within the shard, in
        bounds, any order, repeats allowed) into ``out``, a C-order array
        ``(len(rows), *row shape)`` of the shard's dtype.

        Raises:
          DataError: ``WRONG_SIZE``, the file is no longer the size it had when the
            dataset was opened (truncated or rewritten under the reader).
        """
        mapped = self._mapped
        if mapped is not None and not self._guarded:
            mapped.take(rows, 0, out)
            return
        with self._lock:
            mapped = self._mapped
            if mapped is not None:
                if _fcntl(self._fd, _GETLEASE) == _RDLCK:
                    mapped.take(rows, 0, out)
                    return
                self._let_go()
            self._pread(rows, out)

    def close(self) -> None:
        """Let the lease go and close the file (a later ``read`` is a ``UsageError``)."""
        with self._lock:
            self._let_go()
            self._closed = True
            if self._close_fd is not None:
                self._close_fd()

    def _let_go(self) -> None:
        """The lease is being broken (some process opens the file for writing or
        truncates it), or was: let it go so that process goes on, and never read the
        mapping again (dropping the array unmaps it). Called under ``_lock``."""
        self._mapped = None
        if self._leased:
            self._leased = False
            _let_lease_go(self._fd)

    def read_windows(self, starts: list[int], out: np.ndarray[Any, Any]) -> None:
        """Copy, for each ``starts[i]``, the ``out.shape[1]`` rows from it on into
        ``out[i]`` (a C-order array ``(len(starts), width, *row shape)`` of the file's
        dtype): a token stream's windows, one slice each.

        Raises:
          DataError: as ``read``.
        """
        width = out.shape[1]
        mapped = self._mapped
        if mapped is not None and not self._guarded:
            for i, s in enumerate(starts):
                out[i] = mapped[s : s + width]
            return
        with self._lock:
            mapped = self._mapped
            if mapped is not None:
                if _fcntl(self._fd, _GETLEASE) == _RDLCK:
                    for i, s in enumerate(starts):
                        out[i] = mapped[s : s + width]
                    return
                self._let_go()
            self._check_size()
            view, wb = out.data.cast("B"), width * self.row_bytes
            for i, s in enumerate(starts):
                self._pread_into(view[i * wb : (i + 1) * wb], self.offset + s * self.row_bytes)

    def _changed(self, why: str) -> DataError:
        return data_error(
            DataErrorKind.WRONG_SIZE,
            self.path,
            f"The file {self.path!r} was {self.size} bytes when it was opened and {why}: "
            "it was truncated or rewritten while it was being read. Reading on would give "
            "other rows, or none. Restore the file (or write the data elsewhere, never in "
            "place under a run), then resume from the last checkpoint.",
        )

    def _check_size(self) -> None:
        """Before a pread: the file is open and still the size it was opened at."""
        if self._closed:
            raise UsageError(
                f"The file {self.path!r} was closed (Dataset.close, TokenFile.close); open "
                "it again to read it."
            )
        try:
            now = os.fstat(self._fd).st_size
        except OSError as e:
            raise self._changed(f"cannot be examined any more ({e})") from e
        if now != self.size:
            raise self._changed(f"is now {now} bytes")

    def _pread(self, rows: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
        self._check_size()
        n = int(rows.shape[0])
        if n > 1 and not bool(np.all(rows[1:] > rows[:-1])):
            # Out of order or repeated: read each row once, in file order, then place.
            unique, inverse = np.unique(rows, return_inverse=True)
            buf = np.empty((unique.shape[0], *out.shape[1:]), out.dtype)
            self._pread_increasing(unique, buf)
            buf.take(inverse.reshape(-1), 0, out)
        elif n:
            self._pread_increasing(rows, out)

    def _pread_increasing(self, rows: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
        """Strictly increasing ``rows``: one ``preadv`` per run of adjacent rows."""
        view = out.data.cast("B")
        rb, first = self.row_bytes, rows.tolist()
        cuts = (np.flatnonzero(np.diff(rows) != 1) + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, len(first)], strict=True):
            self._pread_into(view[a * rb : b * rb], self.offset + first[a] * rb)

    def _pread_into(self, part: memoryview, start: int) -> None:
        """Fill ``part`` from the file at byte ``start``; a short file is refused."""
        done = 0
        while done < len(part):
            got = os.preadv(self._fd, [part[done:]], start + done)
            if got == 0:
                raise self._changed("ended before the rows it should hold")
            done += got


def read_npy_header(path: Path) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """A ``.npy`` file's shape, Fortran flag, dtype and data offset (the header only).

    Raises:
      ValueError, OSError, SyntaxError: not a ``.npy`` of format 1.0 or 2.0.
    """
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            # 3.0 only adds utf-8 field names, which no dataset dtype has.
            raise ValueError(f".npy format {version[0]}.{version[1]} is not 1.0 or 2.0")
        return tuple(shape), bool(fortran), np.dtype(dtype), f.tell()


def open_shard_file(
    path: str,
    fd: int,
    size: int,
    offset: int,
    rows: int,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
) -> ShardFile:
    """The shard file ``path`` already opened read-only as ``fd`` (which the result owns;
    closed here on a refusal), checked at ``size`` bytes with ``rows`` rows of
    ``dtype``/``shape`` from ``offset``.

    Raises:
      DataError: ``WRONG_SIZE``, the file's size changed since it was checked.
    """
    expected_shape = (rows, *shape)
    count = rows * math.prod(shape)
    row_bytes = dtype.itemsize * math.prod(shape)
    if rows * row_bytes == 0:
        # Nothing to read (mmap cannot map zero bytes anyway).
        os.close(fd)
        return ShardFile(path, -1, size, offset, row_bytes, np.zeros(expected_shape, dtype), False)
    try:
        leased = _take_lease(fd)
        guarded = leased or not _PREADV  # see the module docstring: Windows
        if os.fstat(fd).st_size != size:  # changed between the caller's check and the lease
            raise data_error(
                DataErrorKind.WRONG_SIZE,
                path,
                f"The shard file {path!r} changed size while it was being opened. Rewrite "
                "the dataset elsewhere (never in place under a run) and open it again.",
            )
        mapped = None
        if guarded:
            # A plain ndarray over the mapping (np.memmap's Python-level __getitem__ would
            # triple the cost of a small gather).
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ, **_NO_FD_COPY)
            mapped = np.frombuffer(mapping, dtype, count, offset).reshape(expected_shape)
    except BaseException:
        os.close(fd)  # also lets the lease go
        raise
    return ShardFile(path, fd, size, offset, row_bytes, mapped, leased)
