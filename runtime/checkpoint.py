"""Checkpoints: safetensors files that PyTorch loads back, written atomically.

Layout (the safetensors format): an 8-byte little-endian header length, a JSON header
mapping each tensor name to its dtype, shape and byte range, then the raw bytes. The
``__metadata__`` entry carries ``stepbundle``: a JSON object with the step count, the
RNG seed, the hyperparameters and the digest of the bundle the state belongs to. Keeping
it inside the file (rather than in a second file) makes the write one atomic rename:
temp file, fsync, rename, fsync of the folder. A crash at any point leaves the previous
checkpoint intact.

Tensors are streamed to disk one by one; nothing joins the whole state in memory.
Readers and writers are written here (the format is one page) so that bf16 state works
without torch; tests cross-check files with the safetensors package itself.

Imports: numpy, stepbundle.schema.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stepbundle.schema.manifest import DType, Manifest

from .dtypes import NUMPY_DTYPES
from .errors import CheckpointError

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = [
    "CHECKPOINT_FORMAT",
    "check_state_values",
    "load_checkpoint",
    "read_safetensors",
    "save_checkpoint",
    "write_safetensors",
]

CHECKPOINT_FORMAT = 1
_MAX_HEADER = 100 * 2**20

_ST_DTYPES: dict[DType, str] = {
    DType.F64: "F64",
    DType.F32: "F32",
    DType.BF16: "BF16",
    DType.F16: "F16",
    DType.I64: "I64",
    DType.I32: "I32",
    DType.I16: "I16",
    DType.I8: "I8",
    DType.U64: "U64",
    DType.U32: "U32",
    DType.U16: "U16",
    DType.U8: "U8",
    DType.BOOL: "BOOL",
}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}
_NP_TO_DTYPE = {v: k for k, v in NUMPY_DTYPES.items()}


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray[Any, Any]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` as a safetensors file, atomically (temp, fsync, rename)."""
    target = Path(path)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    items = []
    for name in sorted(tensors):
        # np.asarray keeps 0-d arrays 0-d (ascontiguousarray would make them 1-d).
        a = np.asarray(tensors[name], order="C")
        dt = _NP_TO_DTYPE.get(a.dtype)
        if dt is None:
            raise CheckpointError(
                f"Tensor {name!r} has dtype {a.dtype}, which checkpoints cannot hold."
            )
        header[name] = {
            "dtype": _ST_DTYPES[dt],
            "shape": [int(d) for d in a.shape],
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        items.append(a)
    raw = json.dumps(header, separators=(",", ":"), sort_keys=False).encode()
    raw += b" " * (-len(raw) % 8)  # the spec allows trailing spaces; 8-align the data
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for a in items:
                if a.size:
                    f.write(a.reshape(-1).view(np.uint8).data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _record(p: Path, name: str, rec: object) -> tuple[np.dtype[Any], tuple[int, ...], int, int]:
    """One tensor record of the header, checked: (dtype, shape, start, end).

    Sizes are Python integers: a hostile shape cannot overflow into a small count.
    """

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{p}: bad safetensors record for {name!r}: {why}.")

    if not isinstance(rec, dict):
        raise bad("not a JSON object")
    st_dtype, shape, offsets = rec.get("dtype"), rec.get("shape"), rec.get("data_offsets")
    if not isinstance(st_dtype, str) or st_dtype not in _FROM_ST:
        raise bad(f"unknown dtype {st_dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"the shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(x) is int and x >= 0 for x in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} are not [start, end] with 0 <= start <= end")
    return NUMPY_DTYPES[_FROM_ST[st_dtype]], tuple(shape), offsets[0], offsets[1]


def read_safetensors(
    path: str | os.PathLike[str],
) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, str]]:
    """Read a safetensors file into numpy arrays (copies) and its metadata.

    Every size in the header is checked against the file before anything is allocated;
    every way the file can be malformed raises ``CheckpointError``.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{p} is too short to be a safetensors checkpoint.")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                (n,) = struct.unpack_from("<Q", mm, 0)
                if n > _MAX_HEADER or 8 + n > size:
                    raise CheckpointError(f"{p} has a corrupt safetensors header length ({n}).")
                try:
                    header = json.loads(bytes(mm[8 : 8 + n]))
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                    raise CheckpointError(
                        f"{p} has a corrupt safetensors header: {type(e).__name__}: {e}."
                    ) from None
                if not isinstance(header, dict):
                    raise CheckpointError(f"{p}: the safetensors header is not a JSON object.")
                meta = header.pop("__metadata__", None) or {}
                if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                    raise CheckpointError(
                        f"{p}: the safetensors __metadata__ is not a map of strings."
                    )
                base = 8 + n
                records = {name: _record(p, name, rec) for name, rec in header.items()}
                out: dict[str, np.ndarray[Any, Any]] = {}
                for name, (dt, shape, start, end) in records.items():
                    count = math.prod(shape)
                    if base + end > size or end - start != count * dt.itemsize:
                        raise CheckpointError(
                            f"{p}: tensor {name!r} lies outside the file or has the wrong size."
                        )
                    out[name] = (
                        np.frombuffer(mm, dtype=dt, count=count, offset=base + start)
                        .reshape(shape)
                        .copy()
                    )
                return out, dict(meta)
    except OSError as e:
        raise CheckpointError(f"Cannot read checkpoint {p}: {e}.") from None


def check_state_values(
    manifest: Manifest, values: Mapping[str, np.ndarray[Any, Any]]
) -> dict[str, np.ndarray[Any, Any]]:
    """Map ``values`` (which may use alias names) onto the state table, checking specs."""
    out: dict[str, np.ndarray[Any, Any]] = {}
    problems = []
    for s in manifest.state:
        names = (s.name, *s.aliases)
        found = next((values[n] for n in names if n in values), None)
        if found is None:
            problems.append(f"missing {s.name!r}")
            continue
        a = np.asarray(found)
        want = NUMPY_DTYPES[s.spec.dtype]
        if a.dtype != want or tuple(a.shape) != s.spec.shape:
            problems.append(f"{s.name!r} is {a.dtype}{list(a.shape)}, the bundle has {s.spec}")
            continue
        out[s.name] = a
    known = {n for s in manifest.state for n in (s.name, *s.aliases)}
    extra = sorted(set(values) - known)
    if extra:
        problems.append(f"unknown name(s) {', '.join(map(repr, extra[:5]))}")
    if problems:
        raise CheckpointError(
            "The state does not match this bundle's state table: "
            + "; ".join(problems[:8])
            + ". Load a checkpoint written for this bundle (same model and optimizer)."
        )
    return out


def save_checkpoint(trainer: Trainer, path: str | os.PathLike[str]) -> None:
    meta = {
        "format": CHECKPOINT_FORMAT,
        "step": trainer.step_count,
        "seed": trainer.seed,
        "hyperparameters": trainer.hyperparameters,
        "bundle_digest": trainer.digest,
    }
    # In a multi-process run every process takes part in gathering the state, process 0
    # writes it, and the others wait until it says whether the file is in place.
    values = trainer.state_dict(include_aliases=True)
    placement = trainer.placement
    failure: CheckpointError | None = None
    if placement.writes_files:
        try:
            write_safetensors(path, values, {"stepbundle": json.dumps(meta, sort_keys=True)})
        except OSError as e:  # every process must still reach the agreement below
            failure = CheckpointError(
                f"Could not write the checkpoint {os.fspath(path)!r}: {e}. The previous "
                "checkpoint files are untouched; free space or fix the folder and save again."
            )
    written = placement.agree(failure is None)
    if failure is not None:
        raise failure
    if not written:
        raise CheckpointError(
            f"Process 0 could not write the checkpoint {os.fspath(path)!r}; its error says why."
        )


def _metadata(path: str | os.PathLike[str], raw: str) -> tuple[int, int | None, dict[str, float]]:
    """The step count, seed and hyperparameters of a checkpoint's metadata, checked."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path} has corrupt stepbundle metadata: {why}.")

    try:
        info = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    if not isinstance(info, dict):
        raise bad("it is not a JSON object")
    missing = [k for k in ("step", "seed", "hyperparameters") if k not in info]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    step, seed, hyper = info["step"], info["seed"], info["hyperparameters"]
    if type(step) is not int or step < 0:
        raise bad(f"the step {step!r} is not a non-negative integer")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**64):
        raise bad(f"the seed {seed!r} is not an integer in [0, 2**64)")
    if not isinstance(hyper, dict) or not all(
        type(v) in (int, float) and math.isfinite(v) for v in hyper.values()
    ):
        raise bad(f"the hyperparameters {hyper!r:.200} are not a map of finite numbers")
    return step, seed, {str(k): float(v) for k, v in hyper.items()}


def load_checkpoint(trainer: Trainer, path: str | os.PathLike[str]) -> None:
    """Restore ``trainer`` from ``path``; everything is checked before anything changes."""
    values, meta = read_safetensors(path)
    raw = meta.get("stepbundle")
    if raw is None:
        raise CheckpointError(
            f"{path} has no stepbundle metadata; it was not written by save_checkpoint. "
            "Use trainer.load_state_dict for plain state."
        )
    step, seed, hyper = _metadata(path, raw)
    check_state_values(trainer.manifest, values)
    trainer.load_state_dict(values)
    trainer._step = step
    if seed is not None and trainer.seed is not None:
        trainer.seed = seed
    for k, v in hyper.items():
        if k in trainer.hyperparameters:
            trainer.set_hyperparameter(k, v)
