"""A safetensors file, memory-mapped: its header checked, its tensors as read-only views.

The runtime reads safetensors in two ways, both through this one reader: checkpoints
(``checkpoint.read_safetensors`` copies every tensor out) and initial state
(``init_state``), which hands each tensor to the device straight from the mapping and
then lets go of its pages (``release``), so that loading a model holds about one tensor
in host memory, not the whole file.

The format is one page (an 8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}`` plus an optional ``__metadata__`` map of strings,
then the raw bytes); it is read here rather than with the ``safetensors`` package so that
bf16 works without torch (``safetensors.numpy`` has no bf16) and so that every size is
checked, with Python integers, against the file before anything is allocated. The reader
accepts the layouts the safetensors library accepts and no others (tests cross-check
files with it).

Imports: numpy, stepbundle.schema.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.schema.limits import MAX_DIM, MAX_RANK
from stepbundle.schema.manifest import DType, TensorSpec

from ..dtypes import NUMPY_DTYPES, from_safetensors
from ..errors import CheckpointError

__all__ = ["MAX_HEADER", "SafetensorsFile", "TensorRecord", "open_safetensors"]

MAX_HEADER = 100_000_000
"""The safetensors library's own cap on the JSON header (MAX_HEADER_SIZE)."""


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of the file: its dtype and shape, and its bytes ``[start, end)`` of the data."""

    dtype: DType
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.dtype, self.shape)


def _record(p: Path, name: str, rec: object) -> TensorRecord:
    """One tensor record of the header, checked.

    Sizes are Python integers: a hostile shape cannot overflow into a small count.
    """

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{p}: bad safetensors record for {name!r}: {why}.")

    if not isinstance(rec, dict):
        raise bad("not a JSON object")
    code, shape, offsets = rec.get("dtype"), rec.get("shape"), rec.get("data_offsets")
    dtype = from_safetensors(code) if isinstance(code, str) else None
    if dtype is None:
        raise bad(f"unknown dtype {code!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"the shape {shape!r:.200} is not a list of non-negative integers")
    if len(shape) > MAX_RANK:
        raise bad(f"the shape has rank {len(shape)}; at most {MAX_RANK} dimensions are allowed")
    if any(d > MAX_DIM for d in shape):
        raise bad(f"the shape {shape!r:.200} has a dimension above 2**63 - 1")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(x) is int and x >= 0 for x in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} are not [start, end] with 0 <= start <= end")
    return TensorRecord(dtype, tuple(shape), offsets[0], offsets[1])


def _check_layout(p: Path, records: Mapping[str, TensorRecord], data: int) -> None:
    """The byte ranges tile the data exactly, as the safetensors library requires: in
    order of their offsets, each starts where the previous ended (the first at 0), each
    is as long as its dtype and shape say, and the last ends at the end of the file."""
    end = 0
    for name, r in sorted(records.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        dt = NUMPY_DTYPES[r.dtype]
        if r.start != end:
            raise CheckpointError(
                f"{p}: tensor {name!r} starts at byte {r.start} of the data, not at {end} "
                "where the previous one ends; the file is damaged."
            )
        if r.end - r.start != math.prod(r.shape) * dt.itemsize:
            raise CheckpointError(
                f"{p}: tensor {name!r} has {r.end - r.start} bytes, but {dt}{list(r.shape)} "
                f"takes {math.prod(r.shape) * dt.itemsize}; the file is damaged."
            )
        end = r.end
    if end != data:
        raise CheckpointError(
            f"{p}: the tensors take {end} bytes but the file has {data} bytes of data; the "
            "file is truncated or has bytes appended."
        )


class SafetensorsFile:
    """An open, checked safetensors file. Obtain one with ``open_safetensors``.

    Attributes:
      path: the file.
      records: every tensor by name, in header order.
      metadata: the ``__metadata__`` map (empty when absent).
    """

    def __init__(
        self,
        path: Path,
        mapping: mmap.mmap,
        base: int,
        records: dict[str, TensorRecord],
        metadata: dict[str, str],
    ) -> None:
        """Use ``open_safetensors``; this constructor trusts its arguments."""
        self.path = path
        self.records = records
        self.metadata = metadata
        self._mmap: mmap.mmap | None = mapping
        self._base = base

    def array(self, name: str) -> np.ndarray[Any, Any]:
        """Tensor ``name`` as a read-only view of the mapping (no copy)."""
        if self._mmap is None:
            raise CheckpointError(f"{self.path} is closed; open it again.")
        r = self.records[name]
        count = math.prod(r.shape)
        view = np.frombuffer(
            self._mmap, dtype=NUMPY_DTYPES[r.dtype], count=count, offset=self._base + r.start
        )
        return view.reshape(r.shape)

    def release(self, name: str) -> None:
        """Drop tensor ``name``'s pages from this process's memory, once it is copied.

        The mapping is of a file, read-only: the pages stay in the page cache and a
        later read maps them again, so this only keeps the process's resident size near
        one tensor while a model is loaded tensor by tensor. A no-op where the platform
        has no ``madvise``.
        """
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        r = self.records[name]
        start = (self._base + r.start) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(self._mmap), self._base + r.end)
        if end > start:
            with contextlib.suppress(OSError, ValueError):
                self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Release the mapping (once no view of it is alive any more)."""
        if self._mmap is not None:
            # BufferError: views are still alive; the mapping goes away with the last one.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_safetensors(path: str | os.PathLike[str]) -> SafetensorsFile:
    """Open and map a safetensors file, checking its header against the file.

    Every size in the header is checked against the file before anything is allocated;
    every way the file can be malformed raises ``CheckpointError``.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{p} is too short to be a safetensors checkpoint.")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"Cannot read checkpoint {p}: {e}.") from None
    try:
        (n,) = struct.unpack_from("<Q", mm, 0)
        if n > MAX_HEADER or 8 + n > size:
            if bytes(mm[:2]) == b"PK" or bytes(mm[:1]) == b"\x80":
                raise CheckpointError(
                    f"{p} is not a safetensors file: it looks like a torch.save() file "
                    "(a zip archive, or torch's older format), which the runtime does not "
                    "read (it loads no Python objects). Convert it once, in a process with torch "
                    "that trusts the file, with safetensors.torch.save_file(state_dict, "
                    "'model.safetensors')."
                )
            raise CheckpointError(f"{p} has a corrupt safetensors header length ({n}).")
        try:
            header = json.loads(bytes(mm[8 : 8 + n]).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CheckpointError(
                f"{p} has a corrupt safetensors header: {type(e).__name__}: {e}."
            ) from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{p}: the safetensors header is not a JSON object.")
        meta = header.pop("__metadata__", None)
        meta = {} if meta is None else meta
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CheckpointError(f"{p}: the safetensors __metadata__ is not a map of strings.")
        base = 8 + n
        records = {name: _record(p, name, rec) for name, rec in header.items()}
        _check_layout(p, records, size - base)
    except BaseException:
        mm.close()
        raise
    return SafetensorsFile(p, mm, base, records, dict(meta))
