"""Writing a dataset in the on-disk layout (``dataset.py`` describes it), streaming.

``write_dataset`` and ``DatasetWriter`` hold at most one shard's rows in memory: each
shard's ``.npy`` files are written atomically (``stepbundle.schema.atomic.atomic_write``)
as soon as the shard is full, and ``dataset.json`` last, so a folder without the index
is an unfinished write that ``open_dataset`` refuses, never a short dataset.

Imports: numpy, the standard library, stepbundle.schema (and this package's dataset).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from stepbundle.schema.atomic import atomic_write
from stepbundle.schema.errors import UsageError

from .dataset import (
    DATASET_FORMAT,
    DATASET_VERSION,
    DEFAULT_SHARD_BYTES,
    DTYPES,
    INDEX_NAME,
    NAME_PATTERN,
    DataErrorKind,
    Dataset,
    InputSpec,
    data_error,
    open_dataset,
    shard_file_name,
)

__all__ = ["DatasetWriter", "write_dataset"]


class DatasetWriter:
    """Streams rows into a new dataset folder, one shard in memory at a time.

    Use ``append_rows`` (stacked arrays, any number of rows) or ``append`` (one row),
    then ``close`` (writes the last shard and the index). As a context manager, the index
    is written only if the block ends without an exception, so a failed write leaves a
    folder that ``open_dataset`` refuses rather than a short dataset.
    """

    def __init__(self, path: str | os.PathLike[str], *, rows_per_shard: int | None = None):
        if rows_per_shard is not None and (type(rows_per_shard) is not int or rows_per_shard < 1):
            raise UsageError(f"rows_per_shard must be a positive integer, got {rows_per_shard!r}.")
        self.folder = Path(path)
        if self.folder.exists():
            if not self.folder.is_dir() or any(self.folder.iterdir()):
                raise data_error(
                    DataErrorKind.OUTPUT_EXISTS,
                    self.folder,
                    f"Cannot write a dataset into {str(self.folder)!r}: it exists and is "
                    "not an empty folder. Choose a new folder, or delete this one first.",
                )
        else:
            self.folder.mkdir(parents=True)
        self._rows_per_shard = rows_per_shard
        self._specs: tuple[InputSpec, ...] | None = None
        self._buffer: dict[str, np.ndarray[Any, Any]] = {}
        self._filled = 0
        self._shard_rows: list[int] = []
        self._closed = False

    @property
    def rows(self) -> int:
        """Rows appended so far."""
        return sum(self._shard_rows) + self._filled

    def _start(self, first: Mapping[str, np.ndarray[Any, Any]], *, stacked: bool) -> None:
        specs = []
        for name, a in first.items():
            if not isinstance(name, str) or not NAME_PATTERN.match(name):
                raise data_error(
                    DataErrorKind.BAD_ROWS,
                    self.folder,
                    f"Input name {name!r} cannot name shard files; use letters, digits, "
                    "'_', '.' and '-' (not starting with '.' or '-').",
                )
            dtype = np.dtype(a.dtype)
            if dtype.name not in DTYPES or dtype.byteorder == ">":
                raise data_error(
                    DataErrorKind.UNKNOWN_DTYPE,
                    self.folder,
                    f"Input {name!r} has dtype {dtype.str!r}, which a dataset cannot hold; "
                    f"cast it to one of {sorted(DTYPES)} (native byte order).",
                )
            shape = tuple(int(d) for d in (a.shape[1:] if stacked else a.shape))
            specs.append(InputSpec(name, DTYPES[dtype.name], shape))
        if not specs:
            raise data_error(
                DataErrorKind.BAD_ROWS, self.folder, "A row must hold at least one input."
            )
        self._specs = tuple(specs)
        if self._rows_per_shard is None:
            row_bytes = max(1, sum(s.row_bytes for s in specs))
            self._rows_per_shard = max(1, DEFAULT_SHARD_BYTES // row_bytes)
        self._new_buffer()

    def _new_buffer(self) -> None:
        assert self._specs is not None and self._rows_per_shard is not None
        self._buffer = {
            s.name: np.empty((self._rows_per_shard, *s.shape), dtype=s.dtype) for s in self._specs
        }
        self._filled = 0

    def _check(
        self, arrays: Mapping[str, Any], *, stacked: bool
    ) -> dict[str, np.ndarray[Any, Any]]:
        got = {k: np.asarray(v) for k, v in arrays.items()}
        if self._specs is None:
            if stacked:
                for k, a in got.items():
                    if a.ndim < 1:
                        raise data_error(
                            DataErrorKind.BAD_ROWS,
                            self.folder,
                            f"Stacked input {k!r} is a scalar; stacked arrays are shaped "
                            "(rows, *row shape).",
                        )
            self._start(got, stacked=stacked)
        assert self._specs is not None
        names = [s.name for s in self._specs]
        if sorted(got) != sorted(names):
            raise data_error(
                DataErrorKind.BAD_ROWS,
                self.folder,
                f"Rows must hold the inputs {names}; got {sorted(got)} (row {self.rows}).",
            )
        counts = set()
        for s in self._specs:
            a = got[s.name]
            shape = tuple(a.shape[1:]) if stacked else tuple(a.shape)
            if stacked:
                counts.add(int(a.shape[0]) if a.ndim else -1)
            if shape != s.shape or np.dtype(a.dtype) != s.dtype:
                raise data_error(
                    DataErrorKind.BAD_ROWS,
                    self.folder,
                    f"Input {s.name!r} at row {self.rows} is {a.dtype.name}{list(shape)} per "
                    f"row; the dataset's first rows made it {s.dtype.name}{list(s.shape)}. "
                    "Every row must have the same dtype and shape.",
                )
        if len(counts) > 1:
            raise data_error(
                DataErrorKind.BAD_ROWS,
                self.folder,
                f"Stacked inputs must have the same number of rows; got "
                f"{ {k: int(v.shape[0]) for k, v in got.items()} }.",
            )
        return got

    def append(self, row: Mapping[str, Any]) -> None:
        """Append one row: ``{name: array of the row's shape}``."""
        got = self._check(row, stacked=False)
        assert self._rows_per_shard is not None
        for name, a in got.items():
            self._buffer[name][self._filled] = a
        self._filled += 1
        if self._filled == self._rows_per_shard:
            self._flush()

    def append_rows(self, arrays: Mapping[str, Any]) -> None:
        """Append stacked rows: ``{name: array (n, *row shape)}``, the same n for all."""
        got = self._check(arrays, stacked=True)
        assert self._rows_per_shard is not None
        n = int(next(iter(got.values())).shape[0])
        done = 0
        while done < n:
            take = min(n - done, self._rows_per_shard - self._filled)
            for name, a in got.items():
                self._buffer[name][self._filled : self._filled + take] = a[done : done + take]
            self._filled += take
            done += take
            if self._filled == self._rows_per_shard:
                self._flush()

    def _flush(self) -> None:
        if self._filled == 0:
            return
        shard = len(self._shard_rows)
        for name, buf in self._buffer.items():
            part = buf[: self._filled]

            def write(f: BinaryIO, part: np.ndarray[Any, Any] = part) -> None:
                np.lib.format.write_array(f, part, allow_pickle=False)

            atomic_write(self.folder / shard_file_name(name, shard), write)
        self._shard_rows.append(self._filled)
        self._filled = 0

    def close(self) -> None:
        """Write the last shard, then the index. The dataset is readable from here on."""
        if self._closed:
            return
        if self._specs is None or self.rows == 0:
            raise data_error(
                DataErrorKind.BAD_ROWS,
                self.folder,
                f"No rows were written to {str(self.folder)!r}; a dataset needs at least one.",
            )
        self._flush()
        self._buffer = {}
        index = {
            "format": DATASET_FORMAT,
            "version": DATASET_VERSION,
            "rows": sum(self._shard_rows),
            "inputs": {s.name: s.to_json() for s in self._specs},
            "shards": [{"rows": r} for r in self._shard_rows],
        }
        text = json.dumps(index) + "\n"
        atomic_write(self.folder / INDEX_NAME, [text.encode("utf-8")])
        self._closed = True

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()


def write_dataset(
    path: str | os.PathLike[str],
    source: Mapping[str, Any] | Iterable[Mapping[str, Any]],
    *,
    rows_per_shard: int | None = None,
    stacked: bool | None = None,
) -> Dataset:
    """Write a dataset to the new (or empty) folder ``path`` and open it.

    Args:
      path: the folder; created if missing, refused if not empty.
      source: either a mapping ``{name: array (rows, *row shape)}`` (arrays, or memory
        maps: they are copied one shard at a time), or an iterable of rows
        ``{name: array of the row's shape}`` (streamed: never held whole), or, with
        ``stacked=True``, an iterable of chunks ``{name: array (n, *row shape)}`` (e.g.
        the batches of a PyTorch ``DataLoader`` converted to numpy).
      rows_per_shard: rows per shard file; by default about ``DEFAULT_SHARD_BYTES``.
      stacked: whether the iterable's items are chunks of rows rather than single rows
        (ignored for a mapping).

    Raises:
      DataError: the folder is not empty (``OUTPUT_EXISTS``), or the rows disagree with
        each other (``BAD_ROWS``, ``UNKNOWN_DTYPE``).
    """
    writer = DatasetWriter(path, rows_per_shard=rows_per_shard)
    with writer:
        if isinstance(source, Mapping):
            writer.append_rows(source)
        elif stacked:
            for chunk in source:
                writer.append_rows(chunk)
        else:
            for row in source:
                writer.append(row)
    return open_dataset(path)
