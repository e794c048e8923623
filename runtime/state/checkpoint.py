"""The checkpoint file format: safetensors files that PyTorch loads back, written atomically.

Layout (the safetensors format): an 8-byte little-endian header length, a JSON header
mapping each tensor name to its dtype, shape and byte range, then the raw bytes, the
tensors back to back in header order. The ``__metadata__`` entry carries
``stepbundle``: a JSON object, ``CheckpointMeta`` (format, step count, RNG seed,
hyperparameters and the digest of the bundle the state belongs to), whose codec and
format changelog are ``stepbundle.schema.checkpoint_meta``'s (load_into reads it too). Keeping it inside
the file (rather than in a second file) makes the write one atomic rename
(``stepbundle.schema.atomic``): a crash at any point leaves the previous checkpoint
intact.

This module is the format only: what a checkpoint holds and how it is read and
written. Which state goes in and what a trainer does with it is ``Trainer``'s job
(``save_checkpoint``/``load_checkpoint``), the check of state against a bundle's state
table is ``state.py``'s.

A checkpoint at a URL other than ``file://`` (``remote.py``) is uploaded under a
temporary name and moved into place, so a reader never sees part of one; it is read
from a local copy in the system's temporary folder.

Tensors are streamed to disk one by one; nothing joins the whole state in memory. The
writer is written here and the reader is ``tensor_file.py`` (the format is one page) so
that bf16 state works without torch (``safetensors.numpy`` has no bf16); the reader
accepts the layouts the safetensors library accepts and no others, and tests cross-check
files with it.

Imports: numpy, stepbundle.schema, this package's ``remote`` (fsspec, for URLs).
``CheckpointMeta``, ``CHECKPOINT_FORMAT`` and ``SUPPORTED_FORMATS`` are the schema's,
named here as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np

from stepbundle.schema.atomic import atomic_write
from stepbundle.schema.checkpoint_digest import CheckpointDigest
from stepbundle.schema.checkpoint_meta import (
    CHECKPOINT_FORMAT,
    META_KEY,
    SUPPORTED_FORMATS,
    CheckpointMeta,
    parse_checkpoint_metadata,
)

from ..dtypes import NUMPY_DTYPES, SAFETENSORS_CODES, from_numpy
from ..errors import CheckpointError
from ..io import remote
from ..io.tensor_file import SafetensorsFile, open_safetensors

__all__ = [
    "CHECKPOINT_FORMAT",
    "SUPPORTED_FORMATS",
    "CheckpointMeta",
    "OtherBundleError",
    "check_bundle",
    "read_checkpoint",
    "read_safetensors",
    "checkpoint_digest",
    "open_checkpoint",
    "write_checkpoint",
    "write_order",
    "write_safetensors",
]


class OtherBundleError(CheckpointError):
    """The checkpoint was written by another bundle than the one loaded."""


def checkpoint_digest(
    meta: CheckpointMeta,
    values: Mapping[str, np.ndarray[Any, Any]],
    after: Callable[[str], None] | None = None,
) -> str:
    """Hex SHA-256 of a checkpoint of ``values`` (``CheckpointDigest``'s framing).

    ``after(name)`` is called once each tensor is hashed (a mapped file drops its pages).
    """
    digest = CheckpointDigest(meta)
    for name in sorted(values):
        a = np.asarray(values[name], order="C")
        digest.tensor(name, a.dtype.str, a.shape, a.nbytes)
        if a.size:
            digest.update(a.reshape(-1).view(np.uint8).data)
        del a  # before the next tensor is read (a streamed state copies it then)
        if after is not None:
            after(name)
    return digest.hexdigest()


def write_order(names: Iterable[str]) -> list[str]:
    """The order in which ``write_checkpoint`` reads its values: each name once for
    the digest, then once for its bytes, sorted each time. The processes of a job
    take part in the gathers of a streamed write in this order (``named.OrderedReads``).
    """
    once = sorted(names)
    return once + once


def check_bundle(
    meta: CheckpointMeta,
    path: str | os.PathLike[str],
    digest: str,
    *,
    allow_other_bundle: bool = False,
) -> None:
    """Refuse a checkpoint written by another bundle than the one with ``digest``.

    Raises:
      OtherBundleError: the digests differ and ``allow_other_bundle`` is False.
    """
    if meta.bundle_digest != digest and not allow_other_bundle:
        raise OtherBundleError(
            f"The checkpoint {os.fspath(path)} was written by the bundle "
            f"{meta.bundle_digest}, but the loaded bundle is {digest}. Load the bundle that "
            "wrote it, or pass allow_other_bundle=True to load_checkpoint (on the command "
            "line: --allow-other-bundle) to restore it anyway (the state must still match "
            "this bundle's state table)."
        )


Specs = Mapping[str, tuple[np.dtype[Any], tuple[int, ...]]]


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray[Any, Any]],
    metadata: Mapping[str, str] | None = None,
    specs: Specs | None = None,
) -> None:
    """Write ``tensors`` as a safetensors file, atomically (temp, fsync, rename).

    The file gets the permissions ``open(path, "w")`` would give it (the umask's).
    ``path`` may be a URL (``remote.write_object``: temporary object, then a move).

    ``specs`` (each name's dtype and shape), when given, makes the write streamed: the
    header is made from them, and each tensor is read from ``tensors`` only when its
    bytes are written, and dropped after (``named.StreamedState`` copies it from the
    device then).

    Raises:
      CheckpointError: a tensor has a dtype checkpoints cannot hold (nothing written),
        or a streamed tensor does not have its spec's dtype and shape.
      OSError: the file could not be written; ``path`` is untouched.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    items: list[np.ndarray[Any, Any]] = []
    for name in sorted(tensors):
        if specs is not None:
            dtype, shape = specs[name]
            # np.empty of no elements: the header's facts without the tensor's bytes
            a = np.empty((0,), dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        else:
            # np.asarray keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d).
            a = np.asarray(tensors[name], order="C")
            shape, nbytes = a.shape, a.nbytes
        dt = from_numpy(a.dtype)
        if dt is None:
            raise CheckpointError(
                f"Tensor {name!r} has dtype {a.dtype}, which checkpoints cannot hold. Cast it "
                f"to one of {', '.join(sorted(str(d) for d in NUMPY_DTYPES.values()))}."
            )
        header[name] = {
            "dtype": SAFETENSORS_CODES[dt],
            "shape": [int(d) for d in shape],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        if specs is None:
            items.append(a)
    raw = json.dumps(header, separators=(",", ":"), sort_keys=False).encode()
    raw += b" " * (-len(raw) % 8)  # the spec allows trailing spaces; 8-align the data

    def streamed() -> Iterator[np.ndarray[Any, Any]]:
        assert specs is not None
        for name in sorted(tensors):
            a = np.asarray(tensors[name], order="C")
            if (a.dtype, a.shape) != specs[name]:
                raise CheckpointError(
                    f"Tensor {name!r} came as {a.dtype}{list(a.shape)}, but the checkpoint's "
                    f"header was written for {specs[name][0]}{list(specs[name][1])}; nothing "
                    "was written. This is a bug: please report it."
                )
            yield a
            del a  # before the next tensor is read: one on the host at a time

    def write(f: BinaryIO) -> None:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in items if specs is None else streamed():
            if a.size:
                f.write(a.reshape(-1).view(np.uint8).data)
            del a

    target = remote.local_path(path)
    if target is None:
        remote.write_object(os.fspath(path), write)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(target, write)


def read_safetensors(
    path: str | os.PathLike[str],
) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, str]]:
    """Read a safetensors file into numpy arrays (copies) and its metadata.

    Every size in the header is checked against the file before anything is allocated
    (``tensor_file``); every way the file can be malformed raises ``CheckpointError``.
    ``path`` may be a URL: it is read from a local copy.
    """
    with _open_safetensors_at(path) as f:
        return {name: f.array(name).copy() for name in f.records}, dict(f.metadata)


def write_checkpoint(
    path: str | os.PathLike[str],
    values: Mapping[str, np.ndarray[Any, Any]],
    meta: CheckpointMeta,
    specs: Specs | None = None,
) -> None:
    """Write a checkpoint: ``values`` as safetensors, ``meta`` in its metadata.

    With ``specs`` the write is streamed (``write_safetensors``): each tensor is read
    twice, once for the digest the header holds and once to write it, and never kept.

    Raises:
      OSError: the file could not be written; ``path`` is untouched.
    """
    meta = dataclasses.replace(meta, format=CHECKPOINT_FORMAT, sha256=None)
    meta = dataclasses.replace(meta, sha256=checkpoint_digest(meta, values))
    write_safetensors(path, values, {META_KEY: meta.to_json()}, specs)


def read_checkpoint(
    path: str | os.PathLike[str],
) -> tuple[dict[str, np.ndarray[Any, Any]], CheckpointMeta]:
    """Read a checkpoint's state (under the names it was saved with) and metadata.

    Raises:
      CheckpointError: also when the checkpoint's format is not one this reader supports.
      CheckpointError: the file is malformed, or is plain safetensors without metadata.
    """
    with open_checkpoint(path) as (f, meta):
        return {name: f.array(name).copy() for name in f.records}, meta


@contextlib.contextmanager
def open_checkpoint(
    path: str | os.PathLike[str],
) -> Iterator[tuple[SafetensorsFile, CheckpointMeta]]:
    """A checkpoint open for reading tensor by tensor, and its checked metadata.

    Nothing is copied: ``f.array(name)`` is a read-only view of the mapped file (a
    process of a multi-process job copies only its devices' pieces of each tensor from
    it). The digest is checked before this yields, over the whole file one tensor at a
    time, each tensor's pages dropped once hashed (``SafetensorsFile.release``). A URL is
    read from a local copy, kept until the block ends.

    Raises:
      CheckpointError: the file is malformed, damaged (its digest), plain safetensors
        without metadata, or of a format this reader does not support.
    """
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(_open_safetensors_at(path))
        meta = parse_checkpoint_metadata(path, dict(f.metadata))
        if meta.sha256 is not None:
            tensors = {name: f.array(name) for name in f.records}
            if checkpoint_digest(meta, tensors, f.release) != meta.sha256:
                raise CheckpointError(
                    f"{os.fspath(path)} is damaged: its metadata or tensors do not match "
                    "the digest it was written with. Resume from an earlier checkpoint."
                )
            del tensors
        yield f, meta


@contextlib.contextmanager
def _open_safetensors_at(path: str | os.PathLike[str]) -> Iterator[SafetensorsFile]:
    """``open_safetensors`` of a path or a URL (a local copy, named as the URL in errors)."""
    local = remote.local_path(path)
    if local is not None:
        with open_safetensors(local) as f:
            yield f
        return
    url = os.fspath(path)
    with contextlib.ExitStack() as stack:
        try:
            copy = stack.enter_context(remote.downloaded(url, suffix=".safetensors"))
        except remote.RemoteError as e:
            raise CheckpointError(f"Cannot read checkpoint {url}: {e}") from None
        except OSError as e:
            raise CheckpointError(f"Cannot read checkpoint {url}: {e}.") from None
        try:
            f = stack.enter_context(open_safetensors(copy))
        except CheckpointError as e:  # it names the temporary copy: name the URL
            raise CheckpointError(str(e).replace(str(copy), url)) from None
        yield f
