"""A checkpoint file's digest, recomputed from the file with the standard library.

The runtime writes ``CheckpointMeta.sha256`` from the arrays it saves
(``runtime/checkpoint.py``'s ``checkpoint_digest``: the metadata's canonical JSON without
the digest, then per tensor, by name, its name, numpy's dtype string, its shape and its
bytes) and checks it from the arrays it reads. ``load_into`` has torch, not numpy, and
reads tensors through ``safetensors``; it checks the same digest here, from the file's
header and bytes, so both readers refuse the same damaged file. Written by hand because
the digest is this project's own framing; safetensors' header is 8 bytes of length and
JSON, and the bytes are read in 1 MiB pieces.

Imports: standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import BinaryIO

from .checkpoint_meta import CheckpointMeta
from .errors import CheckpointError

__all__ = ["NUMPY_DTYPE_STRINGS", "file_digest", "verify_file"]

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


def file_digest(path: str | os.PathLike[str], meta: CheckpointMeta) -> str:
    """Hex SHA-256 of the checkpoint at ``path`` as the runtime frames it.

    Raises:
      CheckpointError: the file is not a safetensors file this reader can follow.
    """
    name = os.fspath(path)
    h = hashlib.sha256()

    def framed(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    framed(dataclasses.replace(meta, sha256=None).to_json().encode())
    with open(name, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        entries = _entries(name, f, size)
        base = 8 + int.from_bytes(_read(f, 0, 8), "little")
        for key in sorted(entries):
            dtype_str, shape, begin, end = entries[key]
            framed(key.encode())
            framed(f"{dtype_str}{shape}".encode())
            h.update((end - begin).to_bytes(8, "little"))
            f.seek(base + begin)
            left = end - begin
            while left > 0:
                piece = f.read(min(left, _PIECE))
                if not piece:
                    raise CheckpointError(f"{name} is damaged: it ends inside tensor {key!r}.")
                h.update(piece)
                left -= len(piece)
    return h.hexdigest()


def _read(f: BinaryIO, at: int, n: int) -> bytes:
    f.seek(at)
    return f.read(n)


def _entries(name: str, f: BinaryIO, size: int) -> dict[str, tuple[str, list[int], int, int]]:
    """Each tensor's (numpy dtype string, shape, begin, end) from the header, every field
    checked: offsets ordered and inside the file, a shape of non-negative ints.

    Raises:
      CheckpointError: the header is malformed, or names bytes the file does not have.
    """

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{name} is not a checkpoint this version reads: {why}.")

    n = int.from_bytes(_read(f, 0, 8), "little")
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
    return out


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
