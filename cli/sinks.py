"""Where ``stepbundle run`` writes logged steps besides the terminal: a JSON-lines file
(``--metrics-file``) and TensorBoard event files (``--tensorboard``).

Each sink takes :class:`LogRecord` values (plain floats, already read from the device)
and is closed once at the end of the run, whatever ended it. Every record is written
through to the OS as it comes (``record_file.RecordFile``: one ``write(2)``, no buffer, no
thread), so a SIGKILL loses nothing already reported; ``flush()`` (at each checkpoint)
also syncs it to the disk. A write that fails (a full disk) cuts the file back to its last
whole record and raises ``SinkError``. The metrics file's sink is ``metrics_file``
(it holds a lock and may trim the file). TensorBoard events are tensorboardX's protobufs
(no torch), the ``tensorboard`` extra, imported only when asked for.

Both sinks write local files: a ``--metrics-file`` or ``--tensorboard`` given as a URL
is refused up front (``paths.sink_path``), except a ``file://`` URL, which stands for its
path; the checks and the writers then use that one path.

Imports: the standard library; this package's ``record_file``; tensorboardX lazily.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from stepbundle.schema.errors import UsageError

from .record_file import RecordFile, SinkError, close_sink, sync_sink

__all__ = [
    "TENSORBOARD_MISSING",
    "LogRecord",
    "Sink",
    "SinkError",
    "TensorBoard",
    "check_sink_outputs",
    "lr_name",
]

TENSORBOARD_MISSING = (
    "--tensorboard needs tensorboardX, which is not installed: "
    "pip install 'stepbundle[tensorboard]'"
)


def lr_name(hyperparameters: Mapping[str, float]) -> str | None:
    """The hyperparameter reported as the learning rate: ``lr``, else the first ``*.lr``
    (``param_groups.0.lr``); None if the bundle has neither."""
    if "lr" in hyperparameters:
        return "lr"
    return next((n for n in hyperparameters if n.endswith(".lr")), None)


@dataclass(frozen=True)
class LogRecord:
    """One logged training step.

    Attributes:
      step: the global index of the step (0-based; a resumed run continues from its
        checkpoint's step count), the ``step`` of ``--json``'s lines.
      time_s: seconds from the start of this process's training loop to the moment
        the step's metrics were read (so, once the step had finished).
      hyperparameters: every hyperparameter's value for this step, by full name.
      metrics: the step's metrics as plain floats (``runtime.metrics.to_floats``).
      group: ``train``, or ``eval`` for the metrics of an evaluation over a dataset
        (``--eval-data``) made after that step.
    """

    step: int
    time_s: float
    hyperparameters: Mapping[str, float]
    metrics: Mapping[str, float | list[float]]
    group: str = "train"  # "eval" for an evaluation over --eval-data after this step

    @property
    def lr(self) -> float | None:
        name = lr_name(self.hyperparameters)
        return None if name is None else self.hyperparameters[name]


class Sink(Protocol):
    def write(self, record: LogRecord) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    """``--tensorboard DIR``: scalar summaries in a TensorBoard event file.

    Tags: ``train/<metric>`` (``eval/<metric>`` for evaluations) for every scalar metric
    (a metric with several elements gets ``train/<metric>/<i>`` per element) and
    ``hyperparameters/<name>`` for every hyperparameter, each at the record's global step.

    The events are tensorboardX's protobufs (no torch), framed as TFRecords and written
    here, one event per logged step, through ``RecordFile``: written through, not by
    tensorboardX's ``SummaryWriter``, whose writer thread died silently on a full disk
    (its queue then filled, and the run hung for ever) and whose ``flush()`` did not
    drain that queue (a SIGKILL soon after a checkpoint lost the steps just before it).
    Each run writes a file of its own, ``events.out.tfevents.<time>.<host>.<pid>``.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        try:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary
            from tensorboardX.record_writer import masked_crc32c
        except ImportError:
            raise ImportError(TENSORBOARD_MISSING) from None
        self._event, self._summary, self._crc = Event, Summary, masked_crc32c
        stem = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(os.fspath(logdir), stem)
        self._file: RecordFile | None = None
        try:
            os.makedirs(logdir, exist_ok=True)
            for n in range(1, 1000):
                try:
                    self._file = RecordFile(self.path, exclusive=True)
                    break
                except FileExistsError:
                    self.path = os.path.join(os.fspath(logdir), f"{stem}.{n}")
            else:
                raise FileExistsError(errno.EEXIST, "every event file name is taken", self.path)
            self._append(Event(wall_time=time.time(), file_version="brain.Event:2"))
        except OSError as e:
            raise SinkError("--tensorboard", self.path, e, "start the event file") from None

    def _append(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        crcs = struct.pack("<I", self._crc(header)), struct.pack("<I", self._crc(data))
        assert self._file is not None, "the TensorBoard event file is closed"
        self._file.append(b"".join((header, crcs[0], data, crcs[1])))

    def write(self, record: LogRecord) -> None:
        value = self._summary.Value
        values = []
        for name, v in record.metrics.items():
            if isinstance(v, list):
                values += [value(tag=_tag(f"{record.group}/{name}/{i}"), simple_value=x)
                           for i, x in enumerate(v)]  # fmt: skip
            else:
                values.append(value(tag=_tag(f"{record.group}/{name}"), simple_value=v))
        if record.group == "train":
            for name, h in record.hyperparameters.items():
                values.append(value(tag=_tag(f"hyperparameters/{name}"), simple_value=h))
        event = self._event(
            wall_time=time.time(), step=record.step, summary=self._summary(value=values)
        )
        try:
            self._append(event)
        except OSError as e:
            raise SinkError("--tensorboard", self.path, e, f"write step {record.step} to") from None

    def flush(self) -> None:
        sync_sink(self._file, "--tensorboard", self.path)

    def close(self) -> None:
        file, self._file = self._file, None
        close_sink(file, "--tensorboard", self.path)


_INVALID_TAG = re.compile(r"[^-/\w.]")


def _tag(name: str) -> str:
    """The tag tensorboardX's ``add_scalar`` would write for ``name`` (its rule: other
    characters become ``_``, leading slashes go), so curves keep their names."""
    return _INVALID_TAG.sub("_", name).lstrip("/")


def check_sink_outputs(metrics_file: str | None, tensorboard: str | None) -> None:
    """Refuse, before anything is loaded, a ``--metrics-file`` or ``--tensorboard`` that
    could not be written, and ``--tensorboard`` without tensorboardX.

    Raises:
      ValueError: a path is of the wrong kind, or tensorboardX is missing.
      OSError: a folder cannot be created or written into.
    """
    if metrics_file is not None:
        target = Path(metrics_file)
        if target.is_dir():
            raise UsageError(
                f"--metrics-file {metrics_file!r} is a folder; give a file name, e.g. "
                f"{str(target / 'metrics.jsonl')!r}."
            )
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise OSError(
                f"--metrics-file: cannot append to {metrics_file!r} ({e.strerror or e})"
            ) from None
    if tensorboard is not None:
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise UsageError(TENSORBOARD_MISSING) from None
        folder = Path(tensorboard)
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--tensorboard {tensorboard!r} is a file, not a folder.")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".stepbundle-probe-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as e:
            raise OSError(
                f"--tensorboard: cannot write into {tensorboard!r} ({e.strerror or e})"
            ) from None
