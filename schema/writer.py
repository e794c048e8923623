"""Writing a bundle: lay out the sections, validate, and write the file atomically.

``write_bundle`` is the only way a bundle is written: it computes the section table from
the payloads (``assemble``), validates the final manifest as a reader will, and writes
header, manifest, padding and sections through ``atomic_write``, hashing each section as
it goes so that a payload changed under its feet is caught.

Imports: standard library only (and this package).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .atomic import atomic_write
from .errors import IntegrityError
from .layout import HEADER_SIZE, align, pack_header
from .manifest import Manifest, Section, SectionKind
from .validate import validate
from .wire import encode_manifest

__all__ = ["SectionPayload", "assemble", "write_bundle"]

# Sections are hashed and written in slices of this size so that a 500 MB section never
# needs a second in-memory copy.
_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class SectionPayload:
    """The bytes of one section, handed to ``write_bundle``.

    Attributes:
      name: the section's unique name, as the manifest references it.
      kind: what the bytes are.
      data: any C-contiguous object with the buffer protocol (bytes, bytearray,
        memoryview, a numpy array); its raw bytes are written as they are. A tensor's
        bytes must already be little-endian C order (for bfloat16 pass a uint16 view).
    """

    name: str
    kind: SectionKind
    data: bytes | bytearray | memoryview


def _payload_view(payload: SectionPayload, index: int) -> memoryview:
    try:
        view = memoryview(payload.data)
        if not view.c_contiguous:
            raise TypeError("the buffer is not C-contiguous")
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"Payload {index} (section {payload.name!r}): data must be a C-contiguous "
            f"object with the buffer protocol ({e}). Pass bytes, or np.ascontiguousarray(a)."
        ) from e


def assemble(manifest: Manifest, payloads: Sequence[SectionPayload]) -> Manifest:
    """``manifest`` with ``sections`` computed from ``payloads``, laid out in their order.

    Offsets are relative to the data area: the first section at 0, each next one at the
    end of the previous rounded up to a multiple of 64. Does not validate.
    """
    sections: list[Section] = []
    offset = 0
    for i, payload in enumerate(payloads):
        view = _payload_view(payload, i)
        sections.append(
            Section(
                name=payload.name,
                kind=payload.kind,
                offset=offset,
                length=view.nbytes,
                sha256=hashlib.sha256(view).hexdigest(),
            )
        )
        offset = align(offset + view.nbytes)
    return dataclasses.replace(manifest, sections=tuple(sections))


def write_bundle(
    path: str | os.PathLike[str], manifest: Manifest, payloads: Sequence[SectionPayload]
) -> Manifest:
    """Write a bundle atomically and return its final manifest.

    The sections are laid out in payload order (see ``assemble``), the manifest is
    validated, and the file is written with ``atomic_write``: a reader sees the old file
    or the new one, never a partial one. On any error the temporary file is removed and
    ``path`` is untouched. Equal inputs give byte-identical files.

    Raises:
      SchemaValidationError: the manifest breaks a rule of the schema.
      IntegrityError: a payload's bytes changed while the bundle was being written.
      OSError: the file could not be written.
    """
    final = assemble(manifest, payloads)
    manifest_bytes = encode_manifest(final)
    data_start = align(HEADER_SIZE + len(manifest_bytes))
    last = final.sections[-1] if final.sections else None
    file_size = data_start + (last.offset + last.length if last is not None else 0)
    validate(final, file_size, manifest_length=len(manifest_bytes))
    atomic_write(path, _file_chunks(final, manifest_bytes, payloads))
    return final


def _file_chunks(
    final: Manifest, manifest_bytes: bytes, payloads: Sequence[SectionPayload]
) -> Iterator[bytes | memoryview]:
    """The bytes of the file in order; raises IntegrityError when a payload changed."""
    yield pack_header(manifest_bytes)
    yield manifest_bytes
    yield bytes(align(HEADER_SIZE + len(manifest_bytes)) - HEADER_SIZE - len(manifest_bytes))
    position = 0
    for i, (payload, section) in enumerate(zip(payloads, final.sections)):
        yield bytes(section.offset - position)
        view = _payload_view(payload, i)
        digest = hashlib.sha256()
        for start in range(0, view.nbytes, _CHUNK):
            chunk = view[start : start + _CHUNK]
            digest.update(chunk)
            yield chunk
        if view.nbytes != section.length or digest.hexdigest() != section.sha256:
            raise IntegrityError(
                f"The bytes of section {section.name!r} changed while the bundle was "
                "being written; nothing was written. Do not modify payloads during "
                "write_bundle."
            )
        position = section.offset + section.length
