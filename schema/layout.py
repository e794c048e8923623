"""Where things sit in a bundle file: the magic, the 64-byte header, the alignment.

A bundle is the header, the msgpack manifest, zero padding to a multiple of
``ALIGNMENT``, then the data area with every section at an aligned offset. This module
holds the constants of that layout and packs and unpacks the header; the writer
(``writer.py``), the reader (``reader.py``) and ``validate`` all take them from here.

Imports: standard library only (and this package's ``version``).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from .version import FORMAT_VERSION

__all__ = [
    "ALIGNMENT",
    "HEADER_FORMAT",
    "HEADER_SIZE",
    "MAGIC",
    "Header",
    "align",
    "pack_header",
    "unpack_header",
]

MAGIC: bytes = b"\x89SBNDL\r\n"
"""The first 8 bytes of every bundle. The high byte and the CR LF catch transfers that
strip the eighth bit or translate line endings, as in PNG's signature."""

HEADER_SIZE: int = 64
ALIGNMENT: int = 64

HEADER_FORMAT: str = "<8sHHIQ32sQ"
"""magic, major u16, minor u16, reserved u32, manifest length u64, manifest SHA-256,
reserved u64; little-endian, no padding, 64 bytes."""

_HEADER = struct.Struct(HEADER_FORMAT)
assert _HEADER.size == HEADER_SIZE


def align(n: int) -> int:
    """``n`` rounded up to the next multiple of ``ALIGNMENT``."""
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class Header:
    """The fields of a 64-byte header, as read, before any of them is checked.

    Attributes:
      magic: the first 8 bytes; a bundle's are ``MAGIC``.
      version: the format version ``(major, minor)``.
      manifest_length: the manifest's length in bytes.
      manifest_sha256: the SHA-256 digest (32 raw bytes) of the manifest.
      reserved: the two reserved fields (bytes 12-15 and 56-63); both zero in a bundle.
    """

    magic: bytes
    version: tuple[int, int]
    manifest_length: int
    manifest_sha256: bytes
    reserved: tuple[int, int]


def pack_header(manifest_bytes: bytes, version: tuple[int, int] = FORMAT_VERSION) -> bytes:
    """The 64-byte header for ``manifest_bytes`` (magic, version, length, SHA-256)."""
    return _HEADER.pack(
        MAGIC, version[0], version[1], 0, len(manifest_bytes),
        hashlib.sha256(manifest_bytes).digest(), 0,
    )  # fmt: skip


def unpack_header(head: bytes) -> Header:
    """The fields of ``head``, exactly ``HEADER_SIZE`` bytes; nothing is checked."""
    magic, major, minor, reserved1, manifest_length, manifest_sha, reserved2 = _HEADER.unpack(head)
    return Header(magic, (major, minor), manifest_length, manifest_sha, (reserved1, reserved2))
