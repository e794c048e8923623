"""A checkpoint file's digest, recomputed from the file with the standard library.

``CheckpointDigest`` is the digest's one framing: the metadata's canonical JSON without
the digest, then per tensor, by name, its name, numpy's dtype string, its shape and its
bytes. The runtime feeds it the arrays it saves and reads (``runtime/state/checkpoint.py``'s
``checkpoint_digest``); ``load_into`` has torch, not numpy, and reads tensors through
``safetensors``, so ``file_digest`` feeds it the file's header and bytes, and both
readers refuse the same damaged file. Written by hand because the digest is this
project's own framing; safetensors' header is 8 bytes of length and JSON, and the bytes
are read in 1 MiB pieces.

Imports: standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from typing import BinaryIO

from .checkpoint_meta import CheckpointMeta
from .errors import CheckpointError

__all__ = ["NUMPY_DTYPE_STRINGS", "CheckpointDigest", "file_digest", "verify_file"]

NUMPY_DTYPE_STRINGS: dict[str, str] = {
    "F64": "<f8",
    "F32": "<f4",
    "BF16": "<V2",  # ml_dtypes' bfloat16, as numpy spells it
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "|i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "|u1",
    "BOOL": "|b1",
}
"""numpy's ``dtype.str`` of each safetensors dtype code a checkpoint can hold: what the
digest frames (tests/runtime/test_checkpoint_digest.py holds it to numpy's)."""

_PIECE = 1 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


class CheckpointDigest:
    """SHA-256 of a checkpoint as its ``sha256`` records it: ``tensor`` then ``update``
    with its bytes in C order, for each tensor in the order of the names."""

    def __init__(self, meta: CheckpointMeta) -> None:
        self._h = hashlib.sha256()
        self._framed(dataclasses.replace(meta, sha256=None).to_json().encode())

    def _framed(self, data: bytes) -> None:
        self._h.update(len(data).to_bytes(8, "little"))
        self._h.update(data)

    def tensor(self, name: str, dtype_str: str, shape: Sequence[int], nbytes: int) -> None:
        """Start a tensor: ``dtype_str`` as numpy's ``dtype.str`` spells it."""
        self._framed(name.encode())
        self._framed(f"{dtype_str}{list(shape)}".encode())
        self._h.update(nbytes.to_bytes(8, "little"))

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def file_digest(path: str | os.PathLike[str], meta: CheckpointMeta) -> str:
    """Hex SHA-256 of the checkpoint at ``path`` as the runtime frames it.

    Raises:
      CheckpointError: the file is not a safetensors file this reader can follow.
    """
    name = os.fspath(path)
    digest = CheckpointDigest(meta)
    with open(name, "rb") as f:
        base, entries = _entries(name, f, os.fstat(f.fileno()).st_size)
        for key in sorted(entries):
            dtype_str, shape, begin, end = entries[key]
            digest.tensor(key, dtype_str, shape, end - begin)
            f.seek(base + begin)
            left = end - begin
            while left > 0:
                piece = f.read(min(left, _PIECE))
                if not piece:
                    raise CheckpointError(f"{name} is damaged: it ends inside tensor {key!r}.")
                digest.update(piece)
                left -= len(piece)
    return digest.hexdigest()


def _entries(
    name: str, f: BinaryIO, size: int
) -> tuple[int, dict[str, tuple[str, list[int], int, int]]]:
    """Where the tensors' bytes start, and each tensor's (numpy dtype string, shape, begin,
    end) from the header, every field checked: offsets ordered and inside the file, a
    shape of non-negative ints.

    Raises:
      CheckpointError: the header is malformed, or names bytes the file does not have.
    """

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{name} is not a checkpoint this version reads: {why}.")

    n = int.from_bytes(f.read(8), "little")
    if size < 8 or n > min(size - 8, _MAX_HEADER):
        raise bad(f"its safetensors header claims {n} bytes of a {size}-byte file")
    try:
        header = json.loads(f.read(n))
    except (ValueError, RecursionError) as e:
        raise bad(f"its safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("its safetensors header is not a JSON object")
    data = size - 8 - n
    out = {}
    for key, t in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(t, dict):
            raise bad(f"tensor {key!r} has no description")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in NUMPY_DTYPE_STRINGS:
            raise bad(f"tensor {key!r} has dtype {dtype!r}, which has no digest form")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"tensor {key!r} has shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise bad(f"tensor {key!r} has data_offsets {offsets!r} outside its {data} bytes")
        out[key] = (NUMPY_DTYPE_STRINGS[dtype], shape, offsets[0], offsets[1])
    return 8 + n, out


def verify_file(path: str | os.PathLike[str], meta: CheckpointMeta) -> None:
    """Refuse a checkpoint whose bytes do not match ``meta.sha256`` (format 2 on; a
    checkpoint of format 1 carries no digest and is taken as it is).

    Raises:
      CheckpointError: the file is damaged or truncated.
    """
    if meta.sha256 is not None and file_digest(path, meta) != meta.sha256:
        raise CheckpointError(
            f"{os.fspath(path)} is damaged: its metadata or tensors do not match the digest "
            "it was written with. Use an earlier checkpoint, or the bundle's initial state."
        )
