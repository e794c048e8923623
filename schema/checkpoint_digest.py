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
        n = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(n))
            entries = {k: v for k, v in header.items() if k != "__metadata__"}
            for tensor in entries.values():
                tensor["dtype_str"] = NUMPY_DTYPE_STRINGS[tensor["dtype"]]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{name} is not a checkpoint this version reads: its safetensors header "
                f"is malformed or holds a dtype without a digest form ({e})."
            ) from None
        base = 8 + n
        for key in sorted(entries):
            t = entries[key]
            begin, end = t["data_offsets"]
            framed(key.encode())
            framed(f"{t['dtype_str']}{list(t['shape'])}".encode())
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
