"""A dataset of rows on disk, larger than memory: the folder layout, its writer and reader.

A dataset is a folder holding a small JSON index and, per shard, one plain ``.npy`` file
per input::

    DIR/dataset.json
    DIR/x-00000.npy  DIR/y-00000.npy     (shard 0: rows 0 .. R0-1)
    DIR/x-00001.npy  DIR/y-00001.npy     (shard 1: rows R0 .. R0+R1-1)
    ...

``dataset.json`` (keys in this order; no others are accepted)::

    {"format": "stepbundle.dataset", "version": 1, "rows": 50000,
     "inputs": {"x": {"dtype": "uint8", "shape": [32, 32, 3]},
                "y": {"dtype": "int64", "shape": []}},
     "shards": [{"rows": 8192}, {"rows": 8192}, ...]}

Shard ``i`` of input ``name`` is the file ``f"{name}-{i:05d}.npy"``: a little-endian,
C-order ``.npy`` (format 1.0 or 2.0, never an object array) of shape
``(shard rows, *shape)``. ``rows`` is the sum of the shards' rows. Every file is plain
numpy: ``np.load("x-00003.npy", mmap_mode="r", allow_pickle=False)`` reads it without
stepbundle.

``open_dataset`` checks the index and every shard's ``.npy`` header and file size before
anything is read (each failure is a ``DataError`` with its own ``DataErrorKind``), then
opens the shards read-only, memory-mapped under a read lease where the system grants one
(``shard_file.py``): only the pages of the rows a batch gathers are ever read, so a
dataset far larger than memory costs page cache, not process memory.
``Dataset.gather`` reads any set of rows with one fancy index per input per shard. A
shard truncated or rewritten under a run is a ``DataError`` (``WRONG_SIZE``), never a
SIGBUS: ``shard_file.py`` says how (a lease, else ``pread``) and what it costs.

``dataset_writer.write_dataset`` writes the layout (streaming, shard by shard, the
index last, so a folder without ``dataset.json`` is an unfinished write and is never
read); ``loader.Loader`` turns a dataset into shuffled, resumable batches.

Input names are file-name safe (letters, digits, ``_``, ``.``, ``-``; not starting with
``.`` or ``-``). Dtypes are the numpy ones listed in ``DTYPES`` (bool, ints, uints,
float16/32/64). bfloat16 is not offered: ``.npy`` cannot name it (numpy writes it as
raw ``V2``); store it as uint16 and view it after loading, or as float32.

Imports: numpy, the standard library (and this package's ``dataset_index`` and
``shard_file``, and ``io.file_kinds``). The index, the typed errors and ``InputSpec`` live in
``dataset_index.py`` and are re-exported here.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..io.file_kinds import kind_of
from .dataset_index import (
    DATASET_FORMAT,
    DATASET_VERSION,
    DEFAULT_SHARD_BYTES,
    DTYPES,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    MAX_INDEX_DEPTH,
    NAME_PATTERN,
    DataError,
    DataErrorKind,
    InputSpec,
    check_index,
    check_index_depth,
    data_error,
    shard_file_name,
)
from .shard_file import ShardFile, open_shard_file, read_npy_header

__all__ = [
    "DATASET_FORMAT",
    "DATASET_VERSION",
    "DEFAULT_SHARD_BYTES",
    "DTYPES",
    "INDEX_NAME",
    "NAME_PATTERN",
    "DataError",
    "DataErrorKind",
    "Dataset",
    "InputSpec",
    "ShardFile",
    "data_error",
    "iter_rows",
    "open_dataset",
    "shard_file_name",
]


@dataclass(frozen=True)
class Dataset:
    """An opened, checked dataset whose shard files are open read-only.

    ``close`` lets the shards' leases go and closes them (garbage collection does too).

    Attributes:
      path: the dataset folder.
      rows: the number of rows.
      inputs: each input's spec, in the index's order.
      shard_rows: the rows of each shard, in order.
      shard_starts: the first global row of each shard, plus ``rows`` at the end.
      files: per input name, per shard, the opened file (``shard_file.ShardFile``).
    """

    path: str
    rows: int
    inputs: tuple[InputSpec, ...]
    shard_rows: tuple[int, ...]
    shard_starts: np.ndarray[Any, np.dtype[np.int64]]
    files: Mapping[str, tuple[ShardFile, ...]]

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [int(v) for v in self.shard_starts]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.inputs)

    def close(self) -> None:
        """Let every shard's lease go and close its file; a later ``gather`` is a
        ``UsageError``. A process that rewrites a shard in place while it holds the
        dataset open waits for its own lease (``shard_file.py``): close it first."""
        for files in self.files.values():
            for f in files:
                f.close()

    def gather(self, indices: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
        """The rows ``indices`` (global row numbers, any order, repeats allowed), stacked.

        Returns fresh, writable C-order arrays ``(len(indices), *shape)`` per input.
        Reads with one ``np.take`` per input when the rows lie in one shard; otherwise
        one ``np.take`` per input per shard touched, in ascending row order (so the page
        cache reads forward), then puts the rows in the asked order.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = idx.shape[0]
        out = {s.name: np.empty((n, *s.shape), dtype=s.dtype) for s in self.inputs}
        if n == 0:
            return out
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.rows:
            raise IndexError(
                f"Row indices must lie in [0, {self.rows}) for the dataset {self.path!r}; "
                f"got {lo} .. {hi}."
            )
        first = bisect.bisect_right(self._starts, lo) - 1
        if first == bisect.bisect_right(self._starts, hi) - 1:
            # All in one shard (the common case: shards are large): one take per input,
            # straight into the asked order.
            local = idx - self._starts[first] if first else idx
            for name, files in self.files.items():
                files[first].read(local, out[name])
            return out
        order = np.argsort(idx, kind="stable")
        ordered = idx[order]
        in_order = bool(np.array_equal(order, np.arange(n)))
        shard_of = np.searchsorted(self.shard_starts, ordered, side="right") - 1
        local = ordered - self.shard_starts[shard_of]
        # Runs of equal shard number in the sorted indices: one take per input per run.
        cuts = (np.flatnonzero(np.diff(shard_of)) + 1).tolist()
        runs = [
            (int(shard_of[a]), local[a:b], slice(a, b))
            for a, b in zip([0, *cuts], [*cuts, n], strict=True)
        ]
        for name, files in self.files.items():
            dst = out[name] if in_order else np.empty_like(out[name])
            for shard, rows, where in runs:
                files[shard].read(rows, dst[where])
            if not in_order:
                out[name][order] = dst
        return out


def _open_shard(folder: Path, spec: InputSpec, shard: int, rows: int) -> ShardFile:
    path = folder / shard_file_name(spec.name, shard)
    fix = "Rewrite the dataset with stepbundle.runtime.data.dataset_writer.write_dataset."
    try:
        mode = os.stat(path).st_mode  # never opened here: a named pipe would block
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise data_error(
            DataErrorKind.BAD_SHARD,
            path,
            f"The shard file {str(path)!r} cannot be read ({e.strerror or e}). {fix}",
        ) from e
    if mode is None:
        raise data_error(
            DataErrorKind.MISSING_SHARD,
            path,
            f"The dataset {str(folder)!r} lists shard {shard} of input {spec.name!r}, but "
            f"the file {path.name!r} is missing. Restore the file, or {fix[0].lower()}{fix[1:]}",
        )
    if not stat.S_ISREG(mode):  # once reported as "missing" too
        raise data_error(
            DataErrorKind.BAD_SHARD,
            path,
            f"The dataset {str(folder)!r} lists shard {shard} of input {spec.name!r}, and "
            f"{path.name!r} is {kind_of(mode)}, not a .npy file. Put the shard's file "
            f"there, or {fix[0].lower()}{fix[1:]}",
        )
    expected_shape = (rows, *spec.shape)
    try:
        shape, fortran, dtype, offset = read_npy_header(path)
    except (ValueError, OSError, SyntaxError) as e:
        raise data_error(
            DataErrorKind.BAD_SHARD,
            path,
            f"The shard file {str(path)!r} is not a readable .npy file ({e}). {fix}",
        ) from e
    if dtype.hasobject or dtype != spec.dtype or dtype.byteorder == ">":
        raise data_error(
            DataErrorKind.BAD_SHARD,
            path,
            f"The shard file {str(path)!r} holds dtype {dtype.str!r}; the index says "
            f"{spec.dtype.name} (little-endian). {fix}",
        )
    if shape != expected_shape or fortran:
        raise data_error(
            DataErrorKind.BAD_SHARD,
            path,
            f"The shard file {str(path)!r} holds a {'Fortran-order ' if fortran else ''}"
            f"array of shape {shape}; the index says {expected_shape} in C order. {fix}",
        )
    expected_size = offset + rows * spec.row_bytes
    size = path.stat().st_size
    if size != expected_size:
        raise data_error(
            DataErrorKind.WRONG_SIZE,
            path,
            f"The shard file {str(path)!r} is {size} bytes; its header and the index "
            f"({expected_shape} {spec.dtype.name}) need {expected_size}. The file is "
            f"truncated or was appended to. {fix}",
        )
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise data_error(
            DataErrorKind.BAD_SHARD,
            path,
            f"The shard file {str(path)!r} cannot be read ({e.strerror or e}). {fix}",
        ) from e
    return open_shard_file(str(path), fd, size, offset, rows, spec.dtype, spec.shape)


def open_dataset(path: str | os.PathLike[str]) -> Dataset:
    """Open the dataset in folder ``path``, checking its index and every shard first.

    Raises:
      DataError: the folder is not a complete, consistent dataset (``kind`` says why).
    """
    folder = Path(path)
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        try:
            mode: int | None = index_path.stat().st_mode
        except OSError:
            mode = None
        if not folder.is_dir():
            hint = "it is not a folder"
        elif mode is not None:  # there, but a FIFO, a device, a folder: never opened
            hint = f"its {INDEX_NAME} is {kind_of(mode)}, not a regular file"
        else:
            hint = f"it has no {INDEX_NAME} (not a dataset, or a write that did not finish)"
        raise data_error(
            DataErrorKind.MISSING_INDEX,
            index_path,
            f"{str(folder)!r} is not a stepbundle dataset: {hint}. Write one with "
            "stepbundle.runtime.data.dataset_writer.write_dataset (see examples/write_dataset.py)"
            + (", or put the index file it wrote back in place." if mode is not None else "."),
        )
    if index_path.stat().st_size > MAX_INDEX_BYTES:
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"The dataset index {str(index_path)!r} is larger than "
            f"{MAX_INDEX_BYTES} bytes, which no index needs. Rewrite the dataset.",
        )
    try:
        raw = json.loads(index_path.read_bytes().decode("utf-8"))
    except RecursionError:  # the parser's own depth cap: Python's recursion limit
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"The dataset index {str(index_path)!r} is nested deeper than JSON can be read "
            f"here; an index is nested at most {MAX_INDEX_DEPTH} levels deep. It is not "
            "an index: rewrite the dataset with "
            "stepbundle.runtime.data.dataset_writer.write_dataset.",
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"The dataset index {str(index_path)!r} is not valid JSON ({e}). Rewrite the "
            "dataset with stepbundle.runtime.data.dataset_writer.write_dataset.",
        ) from e
    check_index_depth(index_path, raw)
    rows, inputs, shard_rows = check_index(index_path, raw)
    files = {
        spec.name: tuple(_open_shard(folder, spec, i, r) for i, r in enumerate(shard_rows))
        for spec in inputs
    }
    starts = np.zeros(len(shard_rows) + 1, dtype=np.int64)
    np.cumsum(shard_rows, out=starts[1:])
    return Dataset(
        path=str(folder),
        rows=rows,
        inputs=inputs,
        shard_rows=tuple(shard_rows),
        shard_starts=starts,
        files=files,
    )


def iter_rows(
    dataset: Dataset, *, chunk_rows: int = 4096
) -> Iterator[dict[str, np.ndarray[Any, Any]]]:
    """Every row of ``dataset`` in order, as chunks of up to ``chunk_rows`` stacked rows."""
    for start in range(0, dataset.rows, chunk_rows):
        yield dataset.gather(np.arange(start, min(start + chunk_rows, dataset.rows)))
