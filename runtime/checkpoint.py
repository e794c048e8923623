"""The checkpoint file format: safetensors files that PyTorch loads back, written atomically.

Layout (the safetensors format): an 8-byte little-endian header length, a JSON header
mapping each tensor name to its dtype, shape and byte range, then the raw bytes, the
tensors back to back in header order. The ``__metadata__`` entry carries
``stepbundle``: a JSON object, ``CheckpointMeta`` (format, step count, RNG seed,
hyperparameters and the digest of the bundle the state belongs to). Keeping it inside
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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from stepbundle.schema.atomic import atomic_write

from . import remote
from .dtypes import NUMPY_DTYPES, SAFETENSORS_CODES, from_numpy
from .errors import CheckpointError
from .tensor_file import open_safetensors

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointFormatError",
    "CheckpointMeta",
    "OtherBundleError",
    "check_bundle",
    "read_checkpoint",
    "read_safetensors",
    "checkpoint_digest",
    "write_checkpoint",
    "write_safetensors",
]

# Changelog of the checkpoint format (the ``format`` field of the stepbundle metadata).
# The reader accepts exactly the formats in SUPPORTED_FORMATS and refuses any other with
# CheckpointFormatError; a new format keeps the old numbers there for as long as files
# written with them must load.
# 2026-11-30: 1, first version: safetensors, the state under PyTorch's names, metadata
#   "stepbundle" = JSON {format, step, seed, hyperparameters, bundle_digest}.
# 2026-12-01: 1, unchanged on disk; readers now refuse unknown formats and, unless told
#   otherwise, checkpoints written by another bundle.
# 2026-12-01: 2, adds "sha256": the SHA-256 of the metadata (its canonical JSON without
#   this field) and of every tensor's name, dtype, shape and bytes (``checkpoint_digest``),
#   checked on read, so a flipped byte anywhere is refused; and, both
#   optional, "schedules" (hyperparameter name -> schedule spec, or null for a Python
#   function) and "data" (the input pipeline's position, a JSON object), so a resume
#   continues both. Format 1 files (none of these) still load.
CHECKPOINT_FORMAT = 2
SUPPORTED_FORMATS = frozenset({1, 2})

_META_KEY = "stepbundle"


class CheckpointFormatError(CheckpointError):
    """The checkpoint's format number is one this reader does not know."""


class OtherBundleError(CheckpointError):
    """The checkpoint was written by another bundle than the one loaded."""


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def checkpoint_digest(meta: CheckpointMeta, values: Mapping[str, np.ndarray[Any, Any]]) -> str:
    """Hex SHA-256 of a checkpoint: its metadata's canonical JSON (without the digest),
    then for each tensor, sorted by name, its name, dtype, shape and byte count (each
    length-prefixed) and its bytes in C order."""
    h = hashlib.sha256()

    def framed(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    framed(dataclasses.replace(meta, sha256=None).to_json().encode())
    for name in sorted(values):
        a = np.asarray(values[name], order="C")
        framed(name.encode())
        framed(f"{a.dtype.str}{list(a.shape)}".encode())
        h.update(a.nbytes.to_bytes(8, "little"))
        if a.size:
            h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _finite_number(v: object) -> bool:
    if type(v) is int:
        return -(2**53) <= v <= 2**53  # exact as a float (10**400 would overflow)
    return type(v) is float and math.isfinite(v)


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint holds besides the state: the ``stepbundle`` metadata entry.

    Attributes:
      format: the checkpoint format number (``CHECKPOINT_FORMAT`` when written here).
      step: the number of training steps taken when it was saved.
      seed: the RNG seed the next training step receives; None when the bundle's
        programs use no random numbers.
      hyperparameters: every hyperparameter's value by name.
      bundle_digest: the digest ("sha256:...") of the bundle the state belongs to.
      sha256: hex SHA-256 over this metadata and every tensor (``checkpoint_digest``);
        format 2 on, None in format 1 files.
      schedules: each scheduled hyperparameter's schedule spec, or None where the
        schedule was a Python function (which a resume must set again).
      data: the input pipeline's position for the next step (a loader's ``state()``),
        or None.
    """

    format: int
    step: int
    seed: int | None
    hyperparameters: Mapping[str, float]
    bundle_digest: str
    sha256: str | None = None
    schedules: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    data: Mapping[str, Any] | None = None

    def to_json(self) -> str:
        bad = {k: v for k, v in self.hyperparameters.items() if not math.isfinite(v)}
        if bad:
            raise CheckpointError(
                f"Cannot write a checkpoint whose hyperparameters are not finite: {bad}. Set "
                "them to finite values first (a reader refuses such a checkpoint)."
            )
        return json.dumps(
            {
                "format": self.format,
                "step": self.step,
                "seed": self.seed,
                "hyperparameters": dict(self.hyperparameters),
                "bundle_digest": self.bundle_digest,
                **({} if self.sha256 is None else {"sha256": self.sha256}),
                **({"schedules": dict(self.schedules)} if self.schedules else {}),
                **({} if self.data is None else {"data": dict(self.data)}),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], raw: str) -> CheckpointMeta:
        """Parse and check the metadata of the checkpoint at ``path``.

        Raises:
          CheckpointFormatError: the format is not one this reader supports.
          CheckpointError: the metadata is malformed.
        """

        def bad(why: str) -> CheckpointError:
            return CheckpointError(f"{os.fspath(path)} has corrupt stepbundle metadata: {why}.")

        try:
            info = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise bad(f"{type(e).__name__}: {e}") from None
        if not isinstance(info, dict):
            raise bad("it is not a JSON object")
        # The format first: a newer format may name its fields differently, and must be
        # reported as a newer format, not as damage.
        if "format" not in info:
            raise bad("missing format")
        fmt = info["format"]
        if type(fmt) is not int or fmt not in SUPPORTED_FORMATS:
            raise CheckpointFormatError(
                f"The checkpoint {os.fspath(path)} has format {fmt!r}, but this version of "
                "stepbundle reads checkpoint formats "
                f"{', '.join(map(str, sorted(SUPPORTED_FORMATS)))} only. Load it with "
                "the stepbundle version that wrote it, or save it again from there."
            )
        missing = [k for k in ("step", "seed", "hyperparameters", "bundle_digest") if k not in info]
        if missing:
            raise bad(f"missing {', '.join(missing)}")
        step, seed, hyper = info["step"], info["seed"], info["hyperparameters"]
        digest = info["bundle_digest"]
        if type(step) is not int or step < 0:
            raise bad(f"the step {step!r} is not a non-negative integer")
        if seed is not None and (type(seed) is not int or not 0 <= seed < 2**64):
            raise bad(f"the seed {seed!r} is not an integer in [0, 2**64)")
        if not isinstance(hyper, dict) or not all(map(_finite_number, hyper.values())):
            raise bad(f"the hyperparameters {hyper!r:.200} are not a map of finite numbers")
        if not isinstance(digest, str):
            raise bad(f"the bundle digest {digest!r:.100} is not a string")
        digest_hex = info.get("sha256")
        if fmt < 2 and digest_hex is not None:
            # Format 1 never wrote a digest: a file that has one was written as format 2
            # and edited to skip the check.
            raise bad("it says format 1 but carries a digest, which only format 2 writes")
        if fmt >= 2 and not (isinstance(digest_hex, str) and _SHA256_HEX.fullmatch(digest_hex)):
            raise bad(f"the digest {digest_hex!r:.100} is not 64 hex digits")
        schedules = info.get("schedules", {}) if fmt >= 2 else {}
        if not isinstance(schedules, dict) or not all(
            isinstance(v, str) or v is None for v in schedules.values()
        ):
            raise bad(f"the schedules {schedules!r:.200} are not a map of specs (or null)")
        data = info.get("data") if fmt >= 2 else None
        if data is not None and not isinstance(data, dict):
            raise bad(f"the data position {data!r:.200} is not a JSON object")
        return cls(
            format=fmt,
            step=step,
            seed=seed,
            hyperparameters={str(k): float(v) for k, v in hyper.items()},
            bundle_digest=digest,
            sha256=digest_hex if fmt >= 2 else None,
            schedules={str(k): v for k, v in schedules.items()},
            data=data,
        )


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


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray[Any, Any]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` as a safetensors file, atomically (temp, fsync, rename).

    The file gets the permissions ``open(path, "w")`` would give it (the umask's).
    ``path`` may be a URL (``remote.write_object``: temporary object, then a move).

    Raises:
      CheckpointError: a tensor has a dtype checkpoints cannot hold (nothing written).
      OSError: the file could not be written; ``path`` is untouched.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    items = []
    for name in sorted(tensors):
        # np.asarray keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d).
        a = np.asarray(tensors[name], order="C")
        dt = from_numpy(a.dtype)
        if dt is None:
            raise CheckpointError(
                f"Tensor {name!r} has dtype {a.dtype}, which checkpoints cannot hold. Cast it "
                f"to one of {', '.join(sorted(str(d) for d in NUMPY_DTYPES.values()))}."
            )
        header[name] = {
            "dtype": SAFETENSORS_CODES[dt],
            "shape": [int(d) for d in a.shape],
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        items.append(a)
    raw = json.dumps(header, separators=(",", ":"), sort_keys=False).encode()
    raw += b" " * (-len(raw) % 8)  # the spec allows trailing spaces; 8-align the data

    def write(f: BinaryIO) -> None:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in items:
            if a.size:
                f.write(a.reshape(-1).view(np.uint8).data)

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
    local = remote.local_path(path)
    if local is None:
        url = os.fspath(path)
        try:
            with remote.downloaded(url, suffix=".safetensors") as copy:
                try:
                    return _read_local(copy)
                except CheckpointError as e:  # it names the temporary copy: name the URL
                    raise CheckpointError(str(e).replace(str(copy), url)) from None
        except remote.RemoteError as e:
            raise CheckpointError(f"Cannot read checkpoint {url}: {e}") from None
        except OSError as e:
            raise CheckpointError(f"Cannot read checkpoint {url}: {e}.") from None
    return _read_local(local)


def _read_local(
    path: str | os.PathLike[str],
) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, str]]:
    with open_safetensors(path) as f:
        return {name: f.array(name).copy() for name in f.records}, dict(f.metadata)


def write_checkpoint(
    path: str | os.PathLike[str], values: Mapping[str, np.ndarray[Any, Any]], meta: CheckpointMeta
) -> None:
    """Write a checkpoint: ``values`` as safetensors, ``meta`` in its metadata.

    Raises:
      OSError: the file could not be written; ``path`` is untouched.
    """
    meta = dataclasses.replace(meta, format=CHECKPOINT_FORMAT, sha256=None)
    meta = dataclasses.replace(meta, sha256=checkpoint_digest(meta, values))
    write_safetensors(path, values, {_META_KEY: meta.to_json()})


def read_checkpoint(
    path: str | os.PathLike[str],
) -> tuple[dict[str, np.ndarray[Any, Any]], CheckpointMeta]:
    """Read a checkpoint's state (under the names it was saved with) and metadata.

    Raises:
      CheckpointFormatError: the checkpoint's format is not one this reader supports.
      CheckpointError: the file is malformed, or is plain safetensors without metadata.
    """
    values, meta = read_safetensors(path)
    raw = meta.get(_META_KEY)
    if raw is None:
        raise CheckpointError(
            f"{os.fspath(path)} has no stepbundle metadata; it was not written by "
            "save_checkpoint. Use trainer.load_state_dict for plain state."
        )
    checked = CheckpointMeta.from_json(path, raw)
    if checked.sha256 is not None and checkpoint_digest(checked, values) != checked.sha256:
        raise CheckpointError(
            f"{os.fspath(path)} is damaged: its metadata or tensors do not match the digest "
            "it was written with. Resume from an earlier checkpoint."
        )
    return values, checked
