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
numpy: ``np.load("x-00003.npy", mmap_mode="r")`` reads it without stepbundle, and
nothing is ever unpickled.

``open_dataset`` checks the index and every shard's ``.npy`` header and file size before
anything is read (each failure is a ``DataError`` with its own ``DataErrorKind``), then
memory-maps the shards read-only: only the pages of the rows a batch gathers are ever
read, so a dataset far larger than memory costs page cache, not process memory.
``Dataset.gather`` reads any set of rows with one fancy index per input per shard.

``dataset_writer.write_dataset`` writes the layout (streaming, shard by shard, the
index last, so a folder without ``dataset.json`` is an unfinished write and is never
read); ``loader.Loader`` turns a dataset into shuffled, resumable batches.

Input names are file-name safe (letters, digits, ``_``, ``.``, ``-``; not starting with
``.`` or ``-``). Dtypes are the numpy ones listed in ``DTYPES`` (bool, ints, uints,
float16/32/64). bfloat16 is not offered: ``.npy`` cannot name it (numpy writes it as
raw ``V2``); store it as uint16 and view it after loading, or as float32.

Imports: numpy, the standard library, stepbundle.schema (and this package's errors).
"""

from __future__ import annotations

import bisect
import enum
import functools
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BindingError

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
    "data_error",
    "iter_rows",
    "open_dataset",
    "shard_file_name",
]

DATASET_FORMAT = "stepbundle.dataset"

# The on-disk dataset layout's version. Readers accept every version up to their own and
# refuse newer ones (naming both); any change to the index or the shard files moves it.
# 1 (2026-12): dataset.json {format, version, rows, inputs{name: {dtype, shape}},
#   shards[{rows}]}; shards are .npy files named f"{name}-{i:05d}.npy".
DATASET_VERSION = 1

INDEX_NAME = "dataset.json"

DEFAULT_SHARD_BYTES = 64 * 1024 * 1024
"""``dataset_writer.write_dataset``'s shard size when ``rows_per_shard`` is not given: about this many
bytes per shard, all inputs together."""

_MAX_INDEX_BYTES = 64 * 1024 * 1024  # an index is small; a huge one is not an index

DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}
"""The dtypes a dataset may hold, by the name the index uses (numpy's name)."""

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")
"""What an input name may look like (it prefixes the shard files' names)."""
_INDEX_KEYS = ("format", "version", "rows", "inputs", "shards")


class DataErrorKind(enum.Enum):
    """What was wrong, one kind per failure (tests match on it, not on wording)."""

    MISSING_INDEX = "missing_index"
    """The folder has no ``dataset.json`` (not a dataset, or an unfinished write)."""
    BAD_INDEX = "bad_index"
    """``dataset.json`` is not JSON, or not an object of the expected keys and types."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """The index names another format or a newer version than this reader's."""
    UNKNOWN_DTYPE = "unknown_dtype"
    """An input's dtype is not one of ``DTYPES``."""
    ROW_COUNT = "row_count"
    """``rows`` differs from the sum of the shards' rows."""
    MISSING_SHARD = "missing_shard"
    """A shard file the index lists does not exist."""
    BAD_SHARD = "bad_shard"
    """A shard file is not a ``.npy`` of the index's dtype and shape (or is Fortran order)."""
    WRONG_SIZE = "wrong_size"
    """A shard file is shorter or longer than its header says."""
    BAD_ROWS = "bad_rows"
    """Rows handed to the writer do not match each other or the inputs' names/shapes."""
    OUTPUT_EXISTS = "output_exists"
    """The writer's folder is not empty."""
    BAD_LOADER = "bad_loader"
    """A loader's arguments do not fit the dataset (batch size, processes, ...)."""
    BAD_STATE = "bad_state"
    """A saved loader state is malformed or belongs to another configuration."""


class DataError(BindingError):
    """A dataset, a loader's arguments or a loader state was refused.

    A ``BindingError`` (so a ``BundleError``): raised before anything is dispatched.
    ``kind`` says which failure; ``path`` is the file concerned, when there is one.
    """

    def __init__(self, kind: DataErrorKind, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.path = path


@dataclass(frozen=True)
class InputSpec:
    """One input of a dataset.

    Attributes:
      name: the batch input's name (also the shard files' prefix).
      dtype: its numpy dtype, one of ``DTYPES``.
      shape: the shape of one row (``()`` for a scalar per row).
    """

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return int(self.dtype.itemsize * math.prod(self.shape))

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype.name, "shape": list(self.shape)}


def shard_file_name(name: str, shard: int) -> str:
    """The file of shard ``shard`` of input ``name``: ``x-00003.npy``."""
    return f"{name}-{shard:05d}.npy"


@dataclass(frozen=True)
class Dataset:
    """An opened, checked dataset whose shards are memory-mapped read-only.

    Attributes:
      path: the dataset folder.
      rows: the number of rows.
      inputs: each input's spec, in the index's order.
      shard_rows: the rows of each shard, in order.
      shard_starts: the first global row of each shard, plus ``rows`` at the end.
      arrays: per input name, one read-only memory map per shard.
    """

    path: str
    rows: int
    inputs: tuple[InputSpec, ...]
    shard_rows: tuple[int, ...]
    shard_starts: np.ndarray[Any, np.dtype[np.int64]]
    arrays: Mapping[str, tuple[np.ndarray[Any, Any], ...]]

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [int(v) for v in self.shard_starts]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.inputs)

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
            for name, maps in self.arrays.items():
                maps[first].take(local, 0, out[name])
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
        for name, maps in self.arrays.items():
            dst = out[name] if in_order else np.empty_like(out[name])
            for shard, rows, where in runs:
                maps[shard].take(rows, 0, dst[where])
            if not in_order:
                out[name][order] = dst
        return out


def data_error(kind: DataErrorKind, path: Path | str, message: str) -> DataError:
    """A ``DataError`` about the file ``path``."""
    return DataError(kind, message, path=str(path))


def _check_index(index_path: Path, raw: object) -> tuple[int, tuple[InputSpec, ...], list[int]]:
    """The index's rows, inputs and shard rows, or a ``DataError`` saying what is wrong."""
    where = f"The dataset index {str(index_path)!r}"
    fix = "Rewrite the dataset with stepbundle.runtime.dataset_writer.write_dataset."
    if not isinstance(raw, dict):
        raise data_error(
            DataErrorKind.BAD_INDEX, index_path, f"{where} is not a JSON object. {fix}"
        )
    if raw.get("format") != DATASET_FORMAT:
        raise data_error(
            DataErrorKind.UNSUPPORTED_VERSION,
            index_path,
            f"{where} has format {raw.get('format')!r}, expected {DATASET_FORMAT!r}: it is "
            f"not a stepbundle dataset. {fix}",
        )
    version = raw.get("version")
    if type(version) is not int or version < 1:
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"{where} has version {version!r}; expected a positive integer. {fix}",
        )
    if version > DATASET_VERSION:
        raise data_error(
            DataErrorKind.UNSUPPORTED_VERSION,
            index_path,
            f"{where} has dataset version {version}; this stepbundle reads versions up to "
            f"{DATASET_VERSION}. Upgrade stepbundle, or rewrite the dataset with this one.",
        )
    keys = set(raw)
    if keys != set(_INDEX_KEYS):
        missing = sorted(set(_INDEX_KEYS) - keys)
        extra = sorted(keys - set(_INDEX_KEYS))
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"{where} must have exactly the keys {list(_INDEX_KEYS)}; missing {missing}, "
            f"unexpected {extra}. {fix}",
        )
    rows = raw["rows"]
    if type(rows) is not int or rows < 1:
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"{where} has rows={rows!r}; expected a positive integer. {fix}",
        )
    inputs_raw = raw["inputs"]
    if not isinstance(inputs_raw, dict) or not inputs_raw:
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"{where} must map at least one input name to {{'dtype', 'shape'}}. {fix}",
        )
    inputs = []
    for name, spec in inputs_raw.items():
        if not NAME_PATTERN.match(name):
            raise data_error(
                DataErrorKind.BAD_INDEX,
                index_path,
                f"{where} names an input {name!r}, which is not a safe file-name prefix "
                f"(letters, digits, '_', '.', '-'; not starting with '.' or '-'). {fix}",
            )
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape"}:
            raise data_error(
                DataErrorKind.BAD_INDEX,
                index_path,
                f"{where} describes input {name!r} as {spec!r}; expected an object with "
                f"exactly 'dtype' and 'shape'. {fix}",
            )
        dtype_name, shape = spec["dtype"], spec["shape"]
        if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
            raise data_error(
                DataErrorKind.UNKNOWN_DTYPE,
                index_path,
                f"{where} gives input {name!r} the dtype {dtype_name!r}, which is not one "
                f"of {sorted(DTYPES)}. Cast the input to one of them and rewrite the dataset.",
            )
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise data_error(
                DataErrorKind.BAD_INDEX,
                index_path,
                f"{where} gives input {name!r} the shape {shape!r}; expected a list of "
                f"non-negative integers (the shape of one row). {fix}",
            )
        inputs.append(InputSpec(name, DTYPES[dtype_name], tuple(shape)))
    shards_raw = raw["shards"]
    if not isinstance(shards_raw, list) or not shards_raw:
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"{where} must list at least one shard as {{'rows': N}}. {fix}",
        )
    shard_rows = []
    for i, s in enumerate(shards_raw):
        if (
            not isinstance(s, dict)
            or set(s) != {"rows"}
            or type(s["rows"]) is not int
            or s["rows"] < 1
        ):
            raise data_error(
                DataErrorKind.BAD_INDEX,
                index_path,
                f"{where} lists shard {i} as {s!r}; expected {{'rows': N}} with N a "
                f"positive integer. {fix}",
            )
        shard_rows.append(int(s["rows"]))
    if sum(shard_rows) != rows:
        raise data_error(
            DataErrorKind.ROW_COUNT,
            index_path,
            f"{where} says rows={rows}, but its {len(shard_rows)} shard(s) hold "
            f"{sum(shard_rows)} rows together. The index does not match its shards; "
            f"{fix[0].lower()}{fix[1:]}",
        )
    return rows, tuple(inputs), shard_rows


def _read_npy_header(path: Path) -> tuple[tuple[int, ...], bool, np.dtype[Any], int]:
    """A ``.npy`` file's shape, Fortran flag, dtype and data offset (nothing unpickled)."""
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


def _open_shard(folder: Path, spec: InputSpec, shard: int, rows: int) -> np.ndarray[Any, Any]:
    path = folder / shard_file_name(spec.name, shard)
    fix = "Rewrite the dataset with stepbundle.runtime.dataset_writer.write_dataset."
    if not path.is_file():
        raise data_error(
            DataErrorKind.MISSING_SHARD,
            path,
            f"The dataset {str(folder)!r} lists shard {shard} of input {spec.name!r}, but "
            f"the file {path.name!r} is missing. Restore the file, or {fix[0].lower()}{fix[1:]}",
        )
    expected_shape = (rows, *spec.shape)
    try:
        shape, fortran, dtype, offset = _read_npy_header(path)
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
    if rows * spec.row_bytes == 0:
        # mmap cannot map zero bytes; a zero-sized row has nothing to read anyway.
        return np.zeros(expected_shape, dtype=spec.dtype)
    # A plain ndarray view of the np.memmap (which it keeps open through .base):
    # memmap's Python-level __getitem__ would triple the cost of a small gather.
    mapped = np.load(path, mmap_mode="r", allow_pickle=False)
    return np.asarray(mapped).view(np.ndarray)


def open_dataset(path: str | os.PathLike[str]) -> Dataset:
    """Open the dataset in folder ``path``, checking its index and every shard first.

    Raises:
      DataError: the folder is not a complete, consistent dataset (``kind`` says why).
    """
    folder = Path(path)
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        hint = (
            "it is not a folder"
            if not folder.is_dir()
            else f"it has no {INDEX_NAME} (not a dataset, or a write that did not finish)"
        )
        raise data_error(
            DataErrorKind.MISSING_INDEX,
            index_path,
            f"{str(folder)!r} is not a stepbundle dataset: {hint}. Write one with "
            "stepbundle.runtime.dataset_writer.write_dataset (see examples/write_dataset.py).",
        )
    if index_path.stat().st_size > _MAX_INDEX_BYTES:
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"The dataset index {str(index_path)!r} is larger than "
            f"{_MAX_INDEX_BYTES} bytes, which no index needs. Rewrite the dataset.",
        )
    try:
        raw = json.loads(index_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise data_error(
            DataErrorKind.BAD_INDEX,
            index_path,
            f"The dataset index {str(index_path)!r} is not valid JSON ({e}). Rewrite the "
            "dataset with stepbundle.runtime.dataset_writer.write_dataset.",
        ) from e
    rows, inputs, shard_rows = _check_index(index_path, raw)
    arrays = {
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
        arrays=arrays,
    )


def iter_rows(
    dataset: Dataset, *, chunk_rows: int = 4096
) -> Iterator[dict[str, np.ndarray[Any, Any]]]:
    """Every row of ``dataset`` in order, as chunks of up to ``chunk_rows`` stacked rows."""
    for start in range(0, dataset.rows, chunk_rows):
        yield dataset.gather(np.arange(start, min(start + chunk_rows, dataset.rows)))
