"""Reading a bundle: ``open_bundle`` checks it and maps it, ``Bundle`` hands out sections.

Opening reads only the header and the manifest: the magic, the version (``version.py``'s
acceptance rule), the manifest's digest, its decoding (``wire.py``) and every cross-field
rule (``validate``). Sections stay in the memory map and are checked against their
SHA-256 the first time they are used, so a 500 MB bundle opens without reading 500 MB.

Imports: standard library only (and this package).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import stat
import typing

from .errors import (
    BundleError,
    BundleFormatError,
    IntegrityError,
    SchemaValidationError,
    UnsupportedVersionError,
)
from .layout import HEADER_SIZE, MAGIC, align, unpack_header
from .limits import MAX_MANIFEST_BYTES
from .manifest import Manifest
from .validate import validate
from .version import FORMAT_VERSION, check_major, check_version, format_version_string
from .wire import guarded, manifest_from_wire
from .wire import unpack as _unpack  # module-level name: integrity tests spy on it here

__all__ = ["Bundle", "open_bundle", "read_manifest"]


class Bundle:
    """An open bundle: its header and manifest parsed, its sections mapped, not read.

    Obtain one with ``open_bundle``. Sections are zero-copy, read-only views of a
    memory map; each section's SHA-256 is checked the first time it is used. Use it as a
    context manager, or call ``close``. Views handed out stay valid after ``close``: the
    mapping is released when the last of them is.
    """

    def __init__(
        self,
        path: str,
        mapping: mmap.mmap,
        version: tuple[int, int],
        header: bytes,
        manifest_bytes: bytes,
        manifest: Manifest,
    ) -> None:
        """Use ``open_bundle``; this constructor trusts its arguments."""
        self._path = path
        self._mmap: mmap.mmap | None = mapping
        self._view: memoryview | None = memoryview(mapping)
        self._version = version
        self._manifest = manifest
        self._manifest_length = len(manifest_bytes)
        self._data_start = align(HEADER_SIZE + len(manifest_bytes))
        self._file_size = len(mapping)
        self._digest = "sha256:" + hashlib.sha256(header + manifest_bytes).hexdigest()
        self._verified: set[str] = set()
        # By name, built once: a runtime asks for every state tensor's section, and a
        # linear search each time would make loading quadratic in the section count.
        self._sections = {s.name: s for s in manifest.sections}

    @property
    def path(self) -> str:
        """The path the bundle was opened from."""
        return self._path

    @property
    def version(self) -> tuple[int, int]:
        """The format version in the file's header, ``(major, minor)``."""
        return self._version

    @property
    def manifest(self) -> Manifest:
        """The decoded, validated manifest."""
        return self._manifest

    @property
    def digest(self) -> str:
        """``"sha256:<hex>"`` of the header and manifest bytes; it pins the whole bundle."""
        return self._digest

    @property
    def file_size(self) -> int:
        """Size of the file in bytes."""
        return self._file_size

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data area; section offsets are relative to it."""
        return self._data_start

    def _bytes(self) -> memoryview:
        if self._view is None:
            raise BundleError(f"The bundle {self._path!r} is closed; open it again.")
        return self._view

    def section(self, name: str) -> memoryview:
        """The bytes of section ``name``: a read-only view into the mapped file.

        Raises:
          KeyError: no section has that name.
          IntegrityError: the section's bytes do not match its SHA-256 (checked once).
        """
        view = self._bytes()
        sec = self._sections.get(name)
        if sec is None:
            raise KeyError(f"The bundle {self._path!r} has no section named {name!r}.")
        start = self._data_start + sec.offset
        data = view[start : start + sec.length]
        if name not in self._verified:
            actual = hashlib.sha256(data).hexdigest()
            if actual != sec.sha256:
                data.release()
                raise IntegrityError(
                    f"Section {name!r} of {self._path!r} is damaged: its SHA-256 is "
                    f"{actual}, but the manifest records {sec.sha256}. The file was altered "
                    "or corrupted after it was written; copy or export it again."
                )
            self._verified.add(name)
        return data

    def verify(self) -> list[str]:
        """Check every section's digest and that all padding is zero.

        Returns human-readable descriptions of every problem found; empty when the
        bundle is intact.
        """
        view = self._bytes()
        failures: list[str] = []

        def check_padding(start: int, end: int, where: str) -> None:
            if any(view[start:end].tobytes()):
                failures.append(f"padding {where} (bytes {start} to {end}) is not all zero")

        check_padding(HEADER_SIZE + self._manifest_length, self._data_start, "after the manifest")
        previous_end = self._data_start
        for sec in self._manifest.sections:
            start = self._data_start + sec.offset
            check_padding(previous_end, start, f"before section {sec.name!r}")
            actual = hashlib.sha256(view[start : start + sec.length]).hexdigest()
            if actual != sec.sha256:
                failures.append(
                    f"section {sec.name!r}: SHA-256 is {actual}, the manifest records {sec.sha256}"
                )
            else:
                self._verified.add(sec.name)
            previous_end = start + sec.length
        return failures

    def close(self) -> None:
        """Release the mapping (once no section view is alive any more)."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mmap is not None:
            # BufferError: section views are still alive; the mapping goes away with the
            # last of them.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    @property
    def closed(self) -> bool:
        """True once ``close`` has been called."""
        return self._view is None

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"<Bundle {self._path!r} format {format_version_string(self._version)} "
            f"{self._digest} {state}>"
        )


def _truncated(path: str, size: int, needed: int, what: str) -> BundleFormatError:
    return BundleFormatError(
        f"{path!r} is truncated: {what} needs {needed} bytes, but the file has only {size}. "
        "Copy or download the bundle again."
    )


def open_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Open and check a bundle: header, manifest digest, version, schema, layout.

    Only the header and manifest are read; sections are mapped and checked when used.

    Raises:
      OSError: the file cannot be opened.
      BundleFormatError: not a bundle, truncated, or malformed.
      UnsupportedVersionError: a version or required feature this reader does not support.
      IntegrityError: the manifest does not match the digest in the header.
      SchemaValidationError: the manifest breaks a rule of the schema.
    """
    fspath = os.fspath(path)
    # O_NONBLOCK: opening a FIFO by mistake must not hang; it has no effect on files.
    fd = os.open(fspath, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BundleFormatError(f"{fspath!r} is not a regular file, so it is not a bundle.")
        if st.st_size == 0:
            raise BundleFormatError(
                f"{fspath!r} is empty (0 bytes), so it is not a bundle. The write that "
                "produced it failed or was interrupted; export it again."
            )
        try:
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except ValueError as e:
            raise BundleFormatError(f"{fspath!r} cannot be memory-mapped: {e}.") from None
    finally:
        os.close(fd)
    try:
        return guarded(lambda: _parse(fspath, mapping))
    except BaseException:
        mapping.close()
        raise


def _parse(path: str, mapping: mmap.mmap) -> Bundle:
    size = len(mapping)
    head = mapping[: min(size, HEADER_SIZE)]
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise BundleFormatError(
            f"{path!r} is not a stepbundle bundle: it starts with {head[:8].hex()}, "
            f"not the magic {MAGIC.hex()}."
        )
    if size < HEADER_SIZE:
        raise _truncated(path, size, HEADER_SIZE, "the header")
    header = unpack_header(head)
    version = header.version
    minor = version[1]
    manifest_length = header.manifest_length
    check_major(version)
    if header.reserved != (0, 0):
        raise BundleFormatError(
            f"{path!r} has non-zero reserved header fields (bytes 12-15 or 56-63); the "
            "header is corrupted."
        )
    if manifest_length > MAX_MANIFEST_BYTES:
        raise BundleFormatError(
            f"{path!r} declares a manifest of {manifest_length} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} bytes a reader accepts; the header is corrupted."
        )
    manifest_end = HEADER_SIZE + manifest_length
    if manifest_end > size:
        raise _truncated(path, size, manifest_end, "the header and manifest")
    manifest_bytes = mapping[HEADER_SIZE:manifest_end]
    if hashlib.sha256(manifest_bytes).digest() != header.manifest_sha256:
        raise IntegrityError(
            f"The manifest of {path!r} does not match the SHA-256 in its header: the file "
            "was altered or corrupted after it was written. Copy or export it again."
        )
    raw = _unpack(manifest_bytes)
    newer = minor > FORMAT_VERSION[1]
    # Refuse unknown required features before decoding the rest, which may use them.
    if isinstance(raw, dict):
        features = raw.get("required_features")
        if isinstance(features, list) and all(type(f) is str for f in features):
            check_version(version, typing.cast(list[str], features))
    try:
        manifest = manifest_from_wire(raw, strict=not newer)
    except SchemaValidationError as e:
        if not newer:
            raise
        raise _newer_minor_error(path, version, e) from None
    check_version(version, manifest.required_features)
    data_start = align(manifest_end)
    if data_start > size:
        raise _truncated(path, size, data_start, "the padding after the manifest")
    # A short data area is reported as truncation, before validate's layout rules.
    ends = [(s.offset + s.length, s.name) for s in manifest.sections]
    if ends:
        end, name = max(ends)
        if data_start + end > size:
            raise _truncated(path, size, data_start + end, f"section {name!r}")
    validate(manifest, size, manifest_length=manifest_length, format_version=version)
    return Bundle(path, mapping, version, bytes(head), manifest_bytes, manifest)


def _newer_minor_error(
    path: str, version: tuple[int, int], error: SchemaValidationError
) -> UnsupportedVersionError:
    """A newer minor's manifest that this reader cannot decode is a version problem."""
    return UnsupportedVersionError(
        f"{path!r} has format version {format_version_string(version)}, newer than this "
        f"reader's {format_version_string(FORMAT_VERSION)}, and uses something this reader "
        f"does not know ({error}). Upgrade stepbundle to read it.",
        found=version,
    )


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Open, check and close a bundle; return its manifest."""
    with open_bundle(path) as bundle:
        return bundle.manifest
