"""The local bundle store: bundles fetched from URLs, kept under their digest.

``load(URL)``, ``stepbundle run URL`` and ``stepbundle pull URL`` fetch a bundle once into
``<cache>/bundles/sha256-<hex>.stepbundle`` (``<cache>`` is ``$STEPBUNDLE_CACHE_DIR``,
else ``~/.cache/stepbundle``), and ``load("sha256:<hex>")`` runs it from there. A file
enters the store only whole and verified, through ``atomic_write``: every section's
SHA-256 and all padding are checked on the finished temporary file before it is renamed
to its digest's name, so a truncated or damaged download never enters it. A bundle in
the store is never fetched again: with a pinned digest the store answers without any
request (each hit's header and manifest are checked against its name first; an entry that
fails is removed and fetched again); without one, the header and manifest (two small ranged reads) name the digest.

A pinned digest (``expect_digest``) is compared with the header and manifest before the
body is requested: another bundle is refused after ``64 + manifest length`` bytes.

The bundle digest covers the header and the manifest, which holds every section's
SHA-256; so a store entry whose name matches its digest and whose sections were all
checked once is exactly the bundle the digest names.

Imports: the standard library, stepbundle.schema, this package's ``remote`` and
``program`` (for the cache folder).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from stepbundle.schema.atomic import atomic_write
from stepbundle.schema.errors import (
    BundleFormatError,
    IntegrityError,
    StepbundleError,
    UsageError,
)
from stepbundle.schema.layout import HEADER_SIZE, MAGIC, align, unpack_header
from stepbundle.schema.limits import MAX_MANIFEST_BYTES
from stepbundle.schema.reader import open_bundle
from stepbundle.schema.version import check_major, check_version
from stepbundle.schema.wire import decode_manifest

from ..errors import BindingError
from . import remote

__all__ = [
    "BundleNotFoundError",
    "DigestMismatchError",
    "DownloadError",
    "NotInStoreError",
    "Pulled",
    "StoreError",
    "default_cache_dir",
    "is_digest",
    "pull",
    "resolve_bundle",
    "store_dir",
    "stored_path",
]

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
_TEMP = re.compile(r"\.sha256-[0-9a-f]{64}\.stepbundle\.tmp-.+\Z")
# The store has no lock, so a temp file is known dead only by its age. A live pull
# changes its file with every chunk it writes (the download is held to a minimum rate,
# remote_errors.TransferPace), and verifying the finished file takes about a second per
# GB: a file unchanged for a day is no live pull's. A process id would not do: it
# means nothing across PID namespaces (containers sharing a store).
STALE_TEMP_AGE_S = 24 * 3600.0

# One debug line per store entry verified in full (``_intact``): a run names its store
# hit once, and tests count these lines to hold it to one verification.
_log = logging.getLogger(__name__)


class DigestMismatchError(BindingError):
    """The bundle at a location is not the one its pinned digest names."""


class NotInStoreError(BindingError):
    """``sha256:<digest>`` names a bundle the local store does not hold."""


class BundleNotFoundError(UsageError, FileNotFoundError):
    """No file at the local path given as a bundle. A ``UsageError`` (the path is the
    caller's to fix), and a ``FileNotFoundError`` as before, with ``filename`` the path."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.errno = errno.ENOENT
        self.filename = path
        self.strerror = os.strerror(errno.ENOENT)

    def __str__(self) -> str:  # not OSError's "[Errno 2] ..."
        return str(self.args[0])


def _missing_bundle(given: str | os.PathLike[str], local: Path) -> BundleNotFoundError:
    where = "" if local.is_absolute() else f" (relative to {os.getcwd()})"
    folder = local.parent
    if local.parent != Path() and not folder.is_dir():
        why = f"its folder {os.fspath(folder)!r} does not exist either"
    else:
        why = "no such file"
    return BundleNotFoundError(
        f"There is no bundle at {os.fspath(given)!r}{where}: {why}. Give the path of a "
        ".stepbundle file (`stepbundle export` or stepbundle.export writes one), a URL, "
        "or sha256:<digest> of a bundle in the local store (`stepbundle pull` puts it there).",
        os.fspath(local),
    )


class DownloadError(remote.RemoteError):
    """A download stopped part way (the server went away, the connection broke)."""


class StoreError(BindingError, OSError):
    """The store's folder cannot hold the bundle: ``$STEPBUNDLE_CACHE_DIR`` is a file,
    the disk is full, or the folder cannot be written. ``filename`` is the folder."""

    def __init__(self, message: str, folder: Path) -> None:
        super().__init__(message)
        self.filename = str(folder)
        self.strerror = message

    def __str__(self) -> str:  # not OSError's "[Errno None] ..."
        return str(self.args[0])


@dataclass(frozen=True)
class Pulled:
    """A bundle in the store.

    Attributes:
      path: its file in the store.
      digest: its digest, ``sha256:<hex>``.
      fetched: whether this call downloaded it (False: it was in the store already).
      bytes_read: bytes this call read from the source (0 when the pinned digest was
        in the store; the header and manifest when only those were needed).
    """

    path: Path
    digest: str
    fetched: bool
    bytes_read: int


def default_cache_dir() -> Path:
    """``$STEPBUNDLE_CACHE_DIR``, else ``$XDG_CACHE_HOME/stepbundle``, else ~/.cache/stepbundle."""
    env = os.environ.get("STEPBUNDLE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stepbundle"


def is_digest(text: str | os.PathLike[str]) -> bool:
    """Whether ``text`` is a bundle reference ``sha256:<64 lowercase hex>``."""
    return isinstance(text, str) and _DIGEST.match(text) is not None


def store_dir() -> Path:
    """The store's folder: ``<compile cache folder>/bundles``.

    Raises:
      StoreError: the cache folder (``$STEPBUNDLE_CACHE_DIR``), or a folder above it, is
        a file.
    """
    root = default_cache_dir() / "bundles"
    for folder in (root, *root.parents):
        if folder.exists() and not folder.is_dir():
            env = os.environ.get("STEPBUNDLE_CACHE_DIR")
            named = f"STEPBUNDLE_CACHE_DIR={env!r}" if env else f"the cache folder {str(folder)!r}"
            raise StoreError(
                f"The bundle store cannot live in {str(root)!r}: {str(folder)!r} is a file, "
                f"not a folder ({named}). Point STEPBUNDLE_CACHE_DIR at a folder (one that "
                "does not exist yet is made), or move the file away.",
                folder,
            )
        if folder.exists():
            break
    return root


def stored_path(digest: str, store: Path | None = None) -> Path:
    """Where the bundle with ``digest`` lives in the store (it may not be there)."""
    if not is_digest(digest):
        raise BindingError(
            f"{digest!r} is not a bundle digest; expected sha256:<64 lowercase hex digits> "
            "(as `stepbundle inspect` prints)."
        )
    return (store or store_dir()) / f"sha256-{digest.removeprefix('sha256:')}.stepbundle"


def resolve_bundle(
    source: str | os.PathLike[str],
    *,
    expect_digest: str | None = None,
    store: Path | None = None,
) -> Path:
    """The local file of a bundle given as a path, a URL or ``sha256:<digest>``.

    A path (or ``file://`` URL) is returned as it is. A digest is looked up in the store.
    Any other URL is pulled into the store (nothing is fetched when ``expect_digest`` is
    already there).

    Raises:
      BundleNotFoundError: a local path (or ``file://`` URL) with no file there.
      NotInStoreError: a digest the store does not hold.
      DigestMismatchError: the source is not the bundle ``expect_digest`` names.
      RemoteError: the URL could not be read; BundleError: it is not a usable bundle.
    """
    if isinstance(source, str) and source.startswith("sha256:") and not is_digest(source):
        hexpart = source.removeprefix("sha256:")
        if re.fullmatch(r"[0-9a-fA-F]{64}", hexpart):
            source = "sha256:" + hexpart.lower()  # the same digest in capitals
        else:
            raise BindingError(
                f"{source[:80]!r} is not a bundle digest: expected sha256: followed by 64 hex "
                f"digits (as `stepbundle inspect` and `stepbundle pull` print), got "
                f"{len(hexpart)} character(s) after 'sha256:'. Copy the whole digest; a local "
                "file whose name starts with sha256: is given as ./NAME."
            )
    if is_digest(source):
        assert isinstance(source, str)
        if expect_digest is not None and expect_digest != source:
            raise DigestMismatchError(
                f"{source} was asked for, but the expected digest is {expect_digest}; "
                "give one of them."
            )
        path = stored_path(source, store)
        if not _intact(path, source):
            raise NotInStoreError(
                f"The bundle {source} is not in the local store ({path.parent}), or its "
                "entry there was damaged and has been removed. Fetch it "
                f"first: stepbundle pull URL --expect-digest {source} (or load the URL, "
                "which fills the store)."
            )
        return path
    local = remote.local_path(source)
    if local is not None:
        try:
            os.stat(local)
        except FileNotFoundError:
            raise _missing_bundle(source, local) from None
        except OSError:  # a link loop, no permission: open_bundle says which
            pass
        return local
    return pull(os.fspath(source), expect_digest=expect_digest, store=store).path


def pull(
    source: str | os.PathLike[str],
    *,
    expect_digest: str | None = None,
    store: Path | None = None,
) -> Pulled:
    """Put the bundle at ``source`` (a URL or a local path) into the store.

    Raises:
      DigestMismatchError: ``expect_digest`` is given and the source's header and
        manifest name another bundle (nothing more is read).
      RemoteError: the source could not be read (a missing object, a server that
        stopped answering mid-transfer, missing credentials); nothing entered the store.
      BundleFormatError, IntegrityError, UnsupportedVersionError: the bytes are not a
        whole, intact bundle this reader supports; nothing entered the store.
    """
    root = store or store_dir()
    sweep_stale_temp_files(root)
    if expect_digest is not None:
        known = stored_path(expect_digest, root)
        if _intact(known, expect_digest):
            return Pulled(known, expect_digest, False, 0)
    text = os.fspath(source)
    local = remote.local_path(source)
    if local is not None:
        with open(local, "rb") as f:
            return _pull_from(f, text, expect_digest, root)
    try:
        with remote.reading(text) as f:
            return _pull_from(f, text, expect_digest, root)
    except FileNotFoundError:
        raise remote.RemoteError(
            f"There is no bundle at {text!r} (not found). Check the URL.", text
        ) from None


def _intact(path: Path, digest: str) -> bool:
    """Whether the store entry ``path`` exists and is the bundle ``digest`` names.

    Every hit is checked, not trusted by its name: the header, the manifest (against the
    header's SHA-256), the file's length against the manifest, the digest of header and
    manifest against ``digest`` (which pins every section's SHA-256), and then every
    section against its SHA-256 (and the padding): an entry damaged after its header
    would otherwise stay, every run from it failing and every pull saying "already
    there". Hashing costs about a second per GB, once per load; a fresh download costs
    more. An entry that fails (truncated, damaged, another bundle copied over it) is
    removed, so the next pull fetches it again.
    """
    if not path.is_file():
        return False
    _log.debug("verifying the store entry %s in full", path)
    try:
        with open_bundle(path) as bundle:
            if bundle.digest == digest and not bundle.verify():
                return True
    except (StepbundleError, OSError):
        pass
    with contextlib.suppress(OSError):
        path.unlink()
    return False


class _Reader(Protocol):
    def read(self, n: int, /) -> bytes: ...


def _read(f: _Reader, n: int, source: str, start: int, total: int) -> bytes:
    """Exactly ``n`` bytes from offset ``start`` (fewer only at the end of the object)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            with remote.failures(source, "download"):
                chunk = f.read(min(n - got, remote.CHUNK))
        except remote.RemoteError as e:
            if type(e) is not remote.RemoteError:  # a timeout, an HTTP status: its own words
                raise
            raise DownloadError(
                f"The download of {source!r} stopped after {start + got} of {total} bytes "
                f"({e.cause}). Nothing entered the store; run again to retry once the "
                "server answers.",
                source,
                e.cause,
            ) from None
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _pull_from(f: _Reader, source: str, expect_digest: str | None, root: Path) -> Pulled:
    head = _read(f, HEADER_SIZE, source, 0, HEADER_SIZE)
    if head[: len(MAGIC)] != MAGIC:
        raise BundleFormatError(
            f"{source!r} is not a stepbundle bundle: it starts with {head[:8].hex()}, not "
            f"the magic {MAGIC.hex()}."
        )
    if len(head) < HEADER_SIZE:
        raise BundleFormatError(
            f"{source!r} is truncated: it ends after {len(head)} bytes, inside the header."
        )
    header = unpack_header(head)
    check_major(header.version)
    length = header.manifest_length
    if length > MAX_MANIFEST_BYTES:
        raise BundleFormatError(
            f"{source!r} declares a manifest of {length} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} a reader accepts; the header is corrupted."
        )
    manifest_bytes = _read(f, length, source, HEADER_SIZE, HEADER_SIZE + length)
    if len(manifest_bytes) < length:
        raise BundleFormatError(
            f"{source!r} is truncated: it ends inside the manifest "
            f"({HEADER_SIZE + len(manifest_bytes)} of {HEADER_SIZE + length} bytes)."
        )
    if hashlib.sha256(manifest_bytes).digest() != header.manifest_sha256:
        raise IntegrityError(
            f"The manifest of {source!r} does not match the SHA-256 in its header: the "
            "object was altered or damaged. Upload or export it again."
        )
    digest = "sha256:" + hashlib.sha256(head + manifest_bytes).hexdigest()
    read = HEADER_SIZE + length
    if expect_digest is not None and digest != expect_digest:
        raise DigestMismatchError(
            f"The bundle at {source!r} has digest {digest}, not the expected "
            f"{expect_digest}. Refusing to fetch or run a different bundle than the one "
            f"pinned (only its {read}-byte header and manifest were read)."
        )
    target = stored_path(digest, root)
    if _intact(target, digest):
        return Pulled(target, digest, False, read)
    manifest = decode_manifest(manifest_bytes, minor=header.version[1])
    check_version(header.version, manifest.required_features)
    data_start = align(read)
    size = data_start + max((s.offset + s.length for s in manifest.sections), default=0)

    def write(out: BinaryIO) -> None:
        nonlocal read
        out.write(head)
        out.write(manifest_bytes)
        while read < size:
            chunk = _read(f, min(size - read, remote.CHUNK), source, read, size)
            if not chunk:
                raise BundleFormatError(
                    f"The download of {source!r} ended after {read} of {size} bytes: the "
                    "object is truncated (an incomplete upload?). Nothing entered the "
                    "store; upload the bundle again."
                )
            out.write(chunk)
            read += len(chunk)
        if _read(f, 1, source, size, size):
            raise BundleFormatError(
                f"{source!r} is longer than the {size} bytes its manifest describes; it is "
                "not a bundle as written. Nothing entered the store."
            )

    def check(temp: str) -> None:
        with open_bundle(temp) as bundle:
            failures = bundle.verify()
        if failures:
            raise IntegrityError(
                f"The bundle downloaded from {source!r} is damaged: {'; '.join(failures)}. "
                "Nothing entered the store; download it again, or upload it again."
            )

    try:
        root.mkdir(parents=True, exist_ok=True)
        atomic_write(target, write, check=check)
    except StepbundleError:
        raise
    except OSError as e:  # the store's own folder or disk, not the source
        raise _store_write_error(e, root, size) from None
    return Pulled(target, digest, True, read)


def _store_write_error(e: OSError, root: Path, size: int) -> StoreError:
    """The typed error for a failed write into the store (nothing entered it)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        free = ""
        with contextlib.suppress(OSError):
            stat = os.statvfs(root)
            free = f", {stat.f_bavail * stat.f_frsize} free"
        why = {errno.ENOSPC: "no space left", errno.EDQUOT: "the disk quota is used up"}
        return StoreError(
            f"Cannot write the bundle into the store {str(root)!r}: "
            f"{why.get(e.errno or 0, 'the file is larger than this process may write')} "
            f"(the bundle needs {size} bytes{free}). Nothing entered the store. Free space "
            "there, or set STEPBUNDLE_CACHE_DIR to a folder on a disk with room.",
            root,
        )
    return StoreError(
        f"Cannot write the bundle into the store {str(root)!r} ({e.strerror or e}). Nothing "
        "entered the store. Make the folder writable, or set STEPBUNDLE_CACHE_DIR to one "
        "that is.",
        root,
    )


def sweep_stale_temp_files(root: Path) -> list[str]:
    """Remove the temp files that interrupted pulls left in the store ``root``.

    A pull writes ``.sha256-<hex>.stepbundle.tmp-<host>-<pid>-<rand>`` and renames it
    onto its entry once verified; a pull that was killed leaves it. One is removed once
    unchanged for ``STALE_TEMP_AGE_S`` (a day), whatever host or process wrote it: the
    store has no lock to tell a live pull from a dead one. Temp files are never entries:
    only ``sha256-<hex>.stepbundle`` names are looked up. Returns the paths removed.
    """
    now = time.time()
    stale = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if _TEMP.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_AGE_S:
                        stale.append(entry.path)
    removed = []
    for path in sorted(stale):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    return removed
