"""``--metrics-file``: one JSON object per logged step, appended to a file that one run
at a time holds.

A run holds an ``flock`` on the file from before its bundle is loaded until it ends (the
kernel drops it when the process ends, SIGKILL included), and refuses a file another
live run holds (``MetricsFileInUseError``, naming that process when ``/proc/locks``
does). Two writers would interleave their rows, and a resumed run's trim would cut rows
from under a live writer.

Only rows this sink wrote are ever removed, and only by a run that writes rows:

- A file is taken only if it is empty or looks like a metrics file: its first and last
  whole lines are rows of this sink (``{"step": <int>, "time": <number>, ...}``, in that
  order), and a last line without its newline, if any, is the start of one. Anything
  else is refused (``NotAMetricsFileError``) untouched: ``--metrics-file train.py`` does
  not lose its last line.
- ``start(resume_at)`` runs when training starts, not before: it cuts off a torn last
  row (a whole row that lacks only its newline gets one) and, for a resumed run, the
  rows of steps ``resume_at`` and later that end the file (a run killed after its last
  checkpoint wrote them; the resumed run writes them again). Those rows end the file
  whenever this sink wrote them, so the trim is one ``ftruncate`` at a line boundary,
  made while holding the lock: atomic, in place, the same inode. A rewrite and rename
  was not used: a rename hands the name to a new inode that the lock does not cover,
  and any writer that does not lock (an older stepbundle) would go on appending to
  the old, deleted one.

Imports: the standard library; ``stepbundle.runtime.train.metrics`` (numpy only);
``stepbundle.schema.errors``; this package's ``record_file`` and ``sinks``.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stepbundle.runtime.train.metrics import json_float, json_safe
from stepbundle.schema.errors import UsageError

from .record_file import RecordFile, SinkError, close_sink, sync_sink
from .sinks import LogRecord

if TYPE_CHECKING:
    from .config import RunConfig

__all__ = [
    "MetricsFile",
    "MetricsFileInUseError",
    "MetricsFileRefusedError",
    "NotAMetricsFileError",
    "check_metrics_file",
    "metrics_file_for_run",
]

# Every row starts with these bytes: json.dumps keeps the key order "step", "time".
_ROW_START = b'{"step": '
# A row longer than this is not one of ours (a row holds a few metrics and vectors).
_MAX_LINE = 64 << 20
_CHUNK = 1 << 20


class MetricsFileRefusedError(UsageError):
    """``--metrics-file`` names a file this run may not write (exit status 2)."""


class MetricsFileInUseError(MetricsFileRefusedError):
    """Another live run holds the metrics file's lock. ``holder`` names it when known."""

    def __init__(self, message: str, holder: str | None) -> None:
        super().__init__(message)
        self.holder = holder


class NotAMetricsFileError(MetricsFileRefusedError):
    """The file holds lines this sink did not write (or is not a regular file)."""


def _step(line: bytes) -> int | None:
    """The step of a row this sink wrote (with or without its newline); None otherwise."""
    if not line.startswith(_ROW_START):
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict):
        return None
    step, time_s = row.get("step"), row.get("time")
    if type(step) is not int or step < 0 or type(time_s) not in (int, float):
        return None
    return step


def _lines_backward(fd: int, end: int) -> Iterator[tuple[int, bytes]]:
    """``(offset, line)`` of the lines of ``fd`` before ``end`` (a line boundary), last
    first. Raises NotAMetricsFileError for a line longer than ``_MAX_LINE``."""
    buf, pos = b"", end
    while pos > 0:
        start = max(0, pos - _CHUNK)
        buf = os.pread(fd, pos - start, start) + buf
        pos = start
        while (cut := buf.rfind(b"\n", 0, len(buf) - 1)) >= 0:
            yield pos + cut + 1, buf[cut + 1 :]
            buf = buf[: cut + 1]
        if len(buf) > _MAX_LINE:
            raise NotAMetricsFileError(f"it has a line longer than {_MAX_LINE} bytes")
    if buf:
        yield 0, buf


def _first_line(fd: int, size: int) -> bytes | None:
    """The first line of ``fd`` with its newline; None if it has no whole line."""
    buf = b""
    while len(buf) < min(size, _MAX_LINE):
        chunk = os.pread(fd, min(_CHUNK, size - len(buf)), len(buf))
        if not chunk:
            break
        buf += chunk
        if (cut := buf.find(b"\n")) >= 0:
            return buf[: cut + 1]
    return None


def _check_shape(fd: int, given: str) -> None:
    """Refuse ``fd`` unless it looks like a metrics file (module docstring).

    Raises:
      NotAMetricsFileError: it does not.
    """
    size = os.fstat(fd).st_size
    try:
        lines = _lines_backward(fd, size)
        last = next(lines, None)
        if last is not None and not last[1].endswith(b"\n") and _step(last[1]) is None:
            text = last[1]
            if not (text.startswith(_ROW_START) or _ROW_START.startswith(text)):
                raise NotAMetricsFileError(f"its last line {_show(text)} is not a row")
            last = next(lines, None)  # torn: the start of a row, cut short
        if last is not None and _step(last[1]) is None:
            raise NotAMetricsFileError(f"its last whole line {_show(last[1])} is not a row")
        first = _first_line(fd, size)
        if first is not None and _step(first) is None:
            raise NotAMetricsFileError(f"its first line {_show(first)} is not a row")
    except NotAMetricsFileError as e:
        raise NotAMetricsFileError(
            f"--metrics-file {given!r} is not a metrics file: {e}. A metrics file holds one "
            'JSON row per logged step ({"step": ..., "time": ..., ...}), and a run appends '
            "to it and may cut rows off its end, so it does not take a file of other lines. "
            "Give a new file name, or the file an earlier run wrote."
        ) from None


def _show(line: bytes) -> str:
    text = line.rstrip(b"\n").decode("utf-8", "replace")
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _lock_holder(fd: int) -> str | None:
    """The process that holds an ``flock`` on ``fd``'s file, from ``/proc/locks`` (Linux;
    a process in another PID namespace shows as 0 or not at all: then None)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            table = f.read()
    except OSError:
        return None
    for row in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter has "->" after "1:".
        parts = row.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key and parts[4] != "0":
            pid = parts[4]
            if pid == str(os.getpid()):
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            except OSError:
                command = ""
            return f"process {pid}" + (f": {command[:200]}" if command else "")
    return None


def check_metrics_file(given: str, *, fresh: bool = False) -> None:
    """Refuse, before anything is loaded, a ``--metrics-file`` that exists and is not a
    metrics file (read only: nothing is locked, created or changed); with ``fresh`` (a
    training run that starts at step 0, not ``--resume``), also one that holds rows.

    Raises:
      NotAMetricsFileError: it is not a regular file, or not a metrics file.
      MetricsFileRefusedError: ``fresh``, and the file holds an earlier run's rows.
    """
    try:
        fd = os.open(given, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAMetricsFileError(
                f"--metrics-file {given!r} is not a regular file; give a file name."
            )
        _check_shape(fd, given)
        if fresh:
            last = next(
                (step for _, line in _lines_backward(fd, os.fstat(fd).st_size)
                 if (step := _step(line)) is not None),
                None,
            )  # fmt: skip
            if last is not None:
                raise MetricsFileRefusedError(
                    f"--metrics-file {given!r} already holds an earlier run's rows (its last "
                    f"is step {last}); this run starts at step 0 and would mix its rows with "
                    "them. Continue that run with --resume CHECKPOINT, or give a new file."
                )
    finally:
        os.close(fd)


class MetricsFile:
    """``--metrics-file``: one JSON object per logged step, appended to a file.

    Each line is ``{"step": ..., "time": ..., "lr": ..., <metric>: ...}`` (``lr`` only
    when the bundle has one; a metric named ``step``, ``time`` or ``lr`` is written as
    ``metric.<name>``). Non-finite values are the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"``, so every line is strict JSON. The file is appended to (a resumed
    run continues it) one whole line per ``write(2)``, so ``tail -f`` follows it, a
    killed run loses nothing it wrote, and a failed write (a full disk) is cut back to
    the last whole line and raised as ``SinkError``.

    Opening it takes the file's lock and checks it (module docstring); nothing is
    changed until ``start``, which ``write`` calls if the caller has not.

    Attributes:
      torn_bytes: bytes of a torn last row ``start`` cut off.
      dropped: rows of steps at or past ``resume_at`` that ``start`` cut off.

    Raises (on opening):
      MetricsFileInUseError: another live process holds the file.
      NotAMetricsFileError: the file is not a regular file, or not a metrics file.
      SinkError: it cannot be opened.
    """

    _RESERVED = frozenset({"step", "time", "lr"})

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.torn_bytes = 0
        self.dropped = 0
        self._started = False
        try:
            self._file: RecordFile | None = RecordFile(self.path)
        except OSError as e:
            raise SinkError("--metrics-file", self.path, e, "open") from None
        try:
            self._lock()
            if not stat.S_ISREG(os.fstat(self._file.fd).st_mode):
                raise NotAMetricsFileError(
                    f"--metrics-file {self.path!r} is not a regular file; give a file name."
                )
            _check_shape(self._file.fd, self.path)
        except BaseException:
            self._file.close()
            raise

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # Windows: no lock
            return
        assert self._file is not None
        try:
            fcntl.flock(self._file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(self._file.fd)
            raise MetricsFileInUseError(
                f"--metrics-file {self.path!r} is being written by another run "
                f"({holder or 'a live process this one cannot name'}), which holds a lock on "
                "it: two runs would interleave their rows, and a resume would cut rows from "
                "under the other. Wait for that run to end, or give this run a metrics file "
                "of its own.",
                holder,
            ) from None
        except OSError as e:  # a file system without locks (some network mounts)
            print(
                f"[run] warning: cannot lock --metrics-file {self.path!r} ({e.strerror or e}); "
                "make sure no other run writes it",
                file=sys.stderr,
            )

    def start(self, resume_at: int | None = None) -> None:
        """Make the file end where this run's rows begin (module docstring): cut a torn
        last row, and with ``resume_at`` the rows of steps ``resume_at`` and later that
        end the file. Runs once; the file stays locked."""
        if self._started:
            return
        self._started = True
        file = self._file
        assert file is not None, "the metrics file is closed"
        try:
            _check_shape(file.fd, self.path)  # as when opened: this run holds the lock
            size = os.fstat(file.fd).st_size
            end, newline = size, False
            for i, (at, line) in enumerate(_lines_backward(file.fd, size)):
                step = _step(line)
                if i == 0 and not line.endswith(b"\n"):
                    if step is None:  # torn: the start of a row, cut short
                        self.torn_bytes, end = size - at, at
                        continue
                    newline = True  # a whole row that lacks only its newline
                if resume_at is None or step is None or step < resume_at:
                    break
                end, newline, self.dropped = at, False, self.dropped + 1
            file.size = size
            if end < size:
                os.ftruncate(file.fd, end)  # one call: the file ends at a line boundary
                file.size = end
                os.fsync(file.fd)
            if newline:
                file.append(b"\n")
        except OSError as e:
            raise SinkError("--metrics-file", self.path, e, "trim") from None

    def write(self, record: LogRecord) -> None:
        self.start()
        assert self._file is not None, "the metrics file is closed"
        line: dict[str, Any] = {"step": record.step, "time": round(record.time_s, 6)}
        lr = record.lr
        if lr is not None:
            line["lr"] = json_float(lr)
        for name, v in json_safe(record.metrics).items():
            if record.group != "train":
                name = f"{record.group}/{name}"
            line[f"metric.{name}" if name in self._RESERVED else name] = v
        data = (json.dumps(line, allow_nan=False) + "\n").encode("utf-8")
        try:
            self._file.append(data)
        except OSError as e:
            raise SinkError(
                "--metrics-file", self.path, e, f"append step {record.step} to"
            ) from None

    def flush(self) -> None:
        sync_sink(self._file, "--metrics-file", self.path)

    def close(self) -> None:
        """Close the file (and so release its lock); idempotent."""
        file, self._file = self._file, None
        close_sink(file, "--metrics-file", self.path)


def metrics_file_for_run(args: RunConfig, joined: bool) -> MetricsFile | None:
    """The ``--metrics-file`` of a training run, opened and locked by the process that
    writes it, for the whole run; None when this process writes none. Nothing in it
    changes until training starts (``MetricsFile.start``)."""
    from stepbundle.runtime.placement import distributed

    if not args.metrics_file or args.entry != "train":
        return None
    if joined and distributed.process_id() != 0:
        return None
    return MetricsFile(args.metrics_file)
