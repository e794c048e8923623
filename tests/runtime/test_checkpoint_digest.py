"""The standard-library digest of a checkpoint file (schema/checkpoint_digest.py, what
``load_into`` checks) against the runtime's digest of the arrays it writes and reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import CheckpointError, load
from stepbundle.runtime.dtypes import NUMPY_DTYPES, SAFETENSORS_CODES
from stepbundle.runtime.state.checkpoint import read_checkpoint, write_checkpoint
from stepbundle.schema.checkpoint_digest import NUMPY_DTYPE_STRINGS, file_digest, verify_file
from stepbundle.schema.checkpoint_meta import CheckpointMeta


def test_every_dtype_is_framed_as_numpy_spells_it() -> None:
    assert {SAFETENSORS_CODES[d]: NUMPY_DTYPES[d].str for d in NUMPY_DTYPES} == NUMPY_DTYPE_STRINGS


def test_a_checkpoint_of_every_dtype_has_the_runtimes_digest(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    values = {
        f"t.{code}": (rng.standard_normal((3, 2)) * 10).astype(NUMPY_DTYPES[d])
        for d, code in SAFETENSORS_CODES.items()
    }
    values["empty"] = np.zeros((0, 4), np.float32)
    values["scalar"] = np.array(7, np.int64)
    meta = CheckpointMeta(
        format=2, step=5, seed=1, hyperparameters={"lr": 0.1}, bundle_digest="sha256:" + "ab" * 32
    )
    path = tmp_path / "c.safetensors"
    write_checkpoint(path, values, meta)
    _, written = read_checkpoint(path)  # the runtime's own check passes
    assert written.sha256 is not None
    assert file_digest(path, written) == written.sha256
    verify_file(path, written)


def test_a_flipped_byte_anywhere_in_a_tensor_is_refused(tmp_path: Path) -> None:
    trainer = load(golden_bundle("linear_adamw"))
    trainer.run(golden_batches("linear_adamw"), 2)
    path = tmp_path / "c.safetensors"
    trainer.save_checkpoint(path)
    _, meta = read_checkpoint(path)
    clean = path.read_bytes()
    header = 8 + int.from_bytes(clean[:8], "little")
    for offset in (header, (header + len(clean)) // 2, len(clean) - 1):
        data = bytearray(clean)
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="is damaged"):
            verify_file(path, meta)


def test_the_metadata_still_reads_as_a_mapping_with_a_warning() -> None:
    """``load_into`` returned a dict before 0.2: ``meta["step"]`` keeps working until 0.3."""
    meta = CheckpointMeta(format=2, step=5, seed=1, hyperparameters={"lr": 0.1}, bundle_digest="x")
    with pytest.warns(DeprecationWarning, match=r"meta\.step"):
        assert meta["step"] == 5
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        meta["stepz"]
    with pytest.warns(DeprecationWarning):
        assert "step" in meta and "stepz" not in meta
        assert meta.get("seed") == 1 and meta.get("stepz", 7) == 7
        assert dict(meta)["hyperparameters"] == {"lr": 0.1}
        assert list(meta)[:2] == ["format", "step"]


def _with_header(
    path: Path, header: object, data: bytes = b"\0" * 16, claim: int | None = None
) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes((len(raw) if claim is None else claim).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize(
    ("header", "claim"),
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [-100, 8]}}, None),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, None),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 2**63]}}, None),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, None),
        ({"t": {"dtype": "F32", "shape": [2]}}, None),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, None),
        ({"t": {"dtype": "C64", "shape": [2], "data_offsets": [0, 8]}}, None),
        ({"t": [1, 2]}, None),
        ([1, 2], None),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 2**64 - 1),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 3 << 30),
    ],
)
def test_a_hostile_header_is_a_checkpoint_error(
    tmp_path: Path, header: object, claim: int | None
) -> None:
    """Whatever the header says, the digest reads only bytes the file has, and a header it
    cannot follow is a CheckpointError, never another exception."""
    meta = CheckpointMeta(format=2, step=1, seed=None, hyperparameters={}, bundle_digest="x")
    path = tmp_path / "c.safetensors"
    _with_header(path, header, claim=claim)
    with pytest.raises(CheckpointError, match="is not a checkpoint this version reads"):
        file_digest(path, meta)
