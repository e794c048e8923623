"""The dataset folder's index (``dataset.json``): its constants, its one-row input specs,
the typed errors of every dataset check, and the check of the index itself.

``dataset.py`` reads the shards the index lists; ``dataset_writer.py`` writes both;
the layout is described in ``dataset.py``'s docstring.

Imports: numpy, the standard library (and this package's errors).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError

__all__ = [
    "DATASET_FORMAT",
    "DATASET_VERSION",
    "DEFAULT_SHARD_BYTES",
    "DTYPES",
    "INDEX_NAME",
    "MAX_INDEX_BYTES",
    "MAX_INDEX_DEPTH",
    "NAME_PATTERN",
    "DataError",
    "DataErrorKind",
    "InputSpec",
    "check_index",
    "check_index_depth",
    "data_error",
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

MAX_INDEX_BYTES = 64 * 1024 * 1024  # an index is small; a huge one is not an index

MAX_INDEX_DEPTH = 8
"""How deeply an index's JSON may nest (a real one: 4, ``{"inputs": {name: {"shape":
[...]}}}``). Deeper is refused before any field is read: the messages quote fields, and
quoting a deeply nested one recursed as deeply as parsing it."""

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
    WRITE_FAILED = "write_failed"
    """A run's metrics output (``--metrics-file``, ``--tensorboard``) could not be written."""


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


def data_error(kind: DataErrorKind, path: Path | str, message: str) -> DataError:
    """A ``DataError`` about the file ``path``."""
    return DataError(kind, message, path=str(path))


def check_index_depth(index_path: Path, raw: object) -> None:
    """Refuse a parsed index nested deeper than ``MAX_INDEX_DEPTH`` (without recursing)."""
    level: list[object] = [raw]
    for _ in range(MAX_INDEX_DEPTH + 1):
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            return
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    raise data_error(
        DataErrorKind.BAD_INDEX,
        index_path,
        f"The dataset index {str(index_path)!r} nests objects or lists more than "
        f"{MAX_INDEX_DEPTH} levels deep; an index is nested 4 levels deep. It is not an "
        "index: rewrite the dataset with stepbundle.runtime.data.dataset_writer.write_dataset.",
    )


def check_index(index_path: Path, raw: object) -> tuple[int, tuple[InputSpec, ...], list[int]]:
    """The index's rows, inputs and shard rows, or a ``DataError`` saying what is wrong."""
    where = f"The dataset index {str(index_path)!r}"
    fix = "Rewrite the dataset with stepbundle.runtime.data.dataset_writer.write_dataset."
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
