"""Byte-exact pin of the format: one small bundle, written deterministically.

The expected digests below were computed once from the writer and are hard-coded on
purpose. They pin format 1.2 (1.0 plus the manifest's empty `metadata` map, nil `numerics`
and `matmul_precision` "default",
each entry's empty `eval_modules` list, and the
header's minor): if this test fails, the bytes a writer produces changed, and
old readers may no longer read new bundles (or the reverse). Do not update the constants
unless the change is a deliberate, versioned format change (see schema/version.py).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from schema_helpers import PROGRAM_BYTES, WEIGHT_BYTES, write_tiny

from stepbundle.schema import open_bundle

EXPECTED_FILE_SHA256 = "4321d12c0425f2316f5077db72ee2299439dcdb39b5384943a5f54c01011524a"
EXPECTED_BUNDLE_DIGEST = "sha256:b58c92fffb19df9ccf4f8b8e247c3576dcca80b2df97122c09627c21b7bd0cf6"
EXPECTED_MANIFEST_LENGTH = 1083


def test_tiny_bundle_bytes_are_pinned(tmp_path: Path) -> None:
    path = tmp_path / "tiny.sbnd"
    write_tiny(path)
    data = path.read_bytes()

    assert hashlib.sha256(data).hexdigest() == EXPECTED_FILE_SHA256

    # The header, field by field.
    assert data[0:8] == b"\x89SBNDL\r\n"
    assert data[8:10] == b"\x01\x00"  # major 1, little-endian u16
    assert data[10:12] == b"\x02\x00"  # minor 2
    assert data[12:16] == bytes(4)  # reserved
    (manifest_length,) = struct.unpack("<Q", data[16:24])
    assert manifest_length == EXPECTED_MANIFEST_LENGTH
    manifest_bytes = data[64 : 64 + manifest_length]
    assert data[24:56] == hashlib.sha256(manifest_bytes).digest()
    assert data[56:64] == bytes(8)

    # Padding to the data area, then the two sections at offsets 0 and 64.
    data_start = 1152  # align64(64 + 1083)
    assert data[64 + manifest_length : data_start] == bytes(data_start - 64 - manifest_length)
    assert data[data_start : data_start + len(PROGRAM_BYTES)] == PROGRAM_BYTES
    assert data[data_start + len(PROGRAM_BYTES) : data_start + 64] == bytes(64 - len(PROGRAM_BYTES))
    assert data[data_start + 64 :] == WEIGHT_BYTES
    assert len(data) == data_start + 64 + len(WEIGHT_BYTES)

    # The manifest starts as a map whose first key is "producer" (field order).
    assert manifest_bytes[0] == 0x8A  # fixmap of 10 entries
    assert manifest_bytes[1:10] == b"\xa8producer"


def test_tiny_bundle_digest_is_pinned(tmp_path: Path) -> None:
    path = tmp_path / "tiny.sbnd"
    write_tiny(path)
    data = path.read_bytes()
    with open_bundle(path) as bundle:
        assert bundle.digest == EXPECTED_BUNDLE_DIGEST
        length = EXPECTED_MANIFEST_LENGTH
        assert bundle.digest == "sha256:" + hashlib.sha256(data[: 64 + length]).hexdigest()
        assert bundle.version == (1, 2)
        assert bundle.file_size == len(data)
