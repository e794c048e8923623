"""Locations that may be URLs: where bundles, checkpoints and compiled programs are kept.

A location is a local path or a URL. Local paths and ``file://`` URLs become local paths
(``local_path``), and the callers' local code runs on them unchanged (``atomic_write``
with its fsyncs, memory maps). Every other URL goes through fsspec, the Python data
ecosystem's file-system layer: the base install reads ``https://`` (fsspec's HTTP
backend, on aiohttp), and ``gs://``, ``s3://``, ``az://``, ... work once the user has
installed fsspec's backend for them (gcsfs, s3fs, adlfs); a missing one is a
``RemoteRefusedError`` that names the package.

Writes are atomic for the reader (``write_object``): the content goes to a temporary
object beside the target, which is then moved onto the target's name. On an object
store a move is a server-side copy that makes the whole object visible at once, and on
file systems reached through fsspec it is a rename, so a reader never sees a partial
upload under the final name, whatever the backend promises about a plain write.

Every failure of a backend (aiohttp's, botocore's, google-auth's and OSError among
them: each backend raises its own types) becomes a ``RemoteError`` naming the URL and
the cause (``remote_errors.py``: HTTP 401/403, 5xx, redirect loops and timeouts each
have their own words, in a ``RemoteRefusedError``); a missing object stays
``FileNotFoundError``, which callers treat as "none there". Every download is held to a
minimum average rate after a grace period (``TransferPace``:
``$STEPBUNDLE_MIN_TRANSFER_RATE``, ``$STEPBUNDLE_TRANSFER_GRACE_S``) and, on HTTP, to 60 s
at most without data per read, and a download into the temporary folder to a size limit
(``$STEPBUNDLE_MAX_DOWNLOAD_BYTES``). ``RemoteError`` is an ``OSError`` as well
as a ``BundleError``, so code that handles a failed local write (a checkpoint, a
compile-cache entry) handles a failed upload the same way.

Imports: the standard library, stepbundle.schema, fsspec (lazily, when a URL is used).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stepbundle.schema.atomic import Chunks, WriteFn
from stepbundle.schema.errors import StepbundleError

from .remote_errors import (
    READ_TIMEOUT_S,
    RemoteError,
    RemoteRefusedError,
    TransferPace,
    classify,
    max_download_bytes,
    response_timeout_error,
    response_timeout_s,
)

__all__ = [
    "RemoteError",
    "RemoteRefusedError",
    "SequentialReader",
    "TransferPace",
    "downloaded",
    "filesystem",
    "is_url",
    "join",
    "list_names",
    "local_path",
    "read_object",
    "reading",
    "check_can_write",
    "check_writable",
    "write_object",
]

CHUNK = 8 << 20
"""Bytes per read of a download (one ranged request each on HTTP and object stores)."""


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is a URL (``scheme://...``, or fsspec's chained ``a::b://``)."""
    return not isinstance(location, os.PathLike) and "://" in location


def local_path(location: str | os.PathLike[str]) -> Path | None:
    """The local path of a path or ``file://`` URL; None for every other URL."""
    if not is_url(location):
        return Path(location)
    text = os.fspath(location)
    if text.startswith("file://") and "::" not in text:
        fs, path = filesystem(text)
        return Path(path)
    return None


def join(location: str, name: str) -> str:
    """``name`` inside the folder ``location`` (a path or a URL)."""
    if is_url(location):
        return location.rstrip("/") + "/" + name
    return os.path.join(location, name)


def filesystem(url: str) -> tuple[Any, str]:
    """fsspec's file system for ``url`` and the path within it.

    Raises:
      RemoteRefusedError: fsspec, or the backend for the URL's scheme, is not installed.
      RemoteError: fsspec knows no such scheme.
    """
    scheme = url.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a base dependency
        raise RemoteRefusedError(
            f"Reading {url!r} needs fsspec, which is not installed: pip install fsspec.", url
        ) from None
    try:
        options: dict[str, Any] = {}
        if scheme in ("http", "https"):
            import aiohttp

            # aiohttp's default limits a whole request to 300 s, which cuts every long
            # download (a server without range requests sends a bundle in one response):
            # no total here. A stalled connection fails after a minute without data, and
            # SequentialReader gives each of its requests a total from the transfer's
            # minimum rate (a trickle of a byte a second defeats sock_read alone).
            timeout = aiohttp.ClientTimeout(total=None, sock_read=READ_TIMEOUT_S)
            options["client_kwargs"] = {"timeout": timeout}
        fs, path = fsspec.core.url_to_fs(url, **options)
        return fs, str(path)
    except ImportError as e:
        from fsspec.registry import known_implementations

        known = known_implementations.get(scheme.split("::")[-1], {})
        package = str(known.get("class", "")).split(".")[0] or f"an fsspec backend for {scheme}"
        raise RemoteRefusedError(
            f"{url!r} needs fsspec's {scheme}:// backend, which is not installed ({e}). "
            f"Install it where stepbundle runs (pip install {package}), or copy the file "
            "somewhere the base install reads: a local path, file:// or https://.",
            url,
        ) from None
    except ValueError as e:
        raise RemoteError(
            f"{url!r} has a scheme fsspec does not know ({e}). Use a local path, file://, "
            "https://, or the URL of an installed fsspec backend (gs://, s3://, ...).",
            url,
        ) from None
    except Exception as e:  # a backend failing as it starts (reference:: reads its file)
        raise RemoteError(
            f"fsspec could not open {url!r} as a file system ({type(e).__name__}: {e}). "
            "Check the URL; a chained URL (a::b://...) also needs what its first part reads "
            "(reference:: needs a references file at the path after ::).",
            url,
            f"{type(e).__name__}: {e}",
        ) from None


@contextlib.contextmanager
def failures(url: str, doing: str, pace: TransferPace | None = None) -> Iterator[None]:
    """Turn a backend's failure while ``doing`` something with ``url`` into RemoteError.

    stepbundle's own errors pass through, and so does ``FileNotFoundError`` when the
    object is really missing (fsspec's HTTP backend raises it for a 403, a 500 or a
    redirect loop too, with the real cause chained: ``classify`` names that). Everything
    else is caught because every backend raises its own types (aiohttp.ClientError,
    botocore's, google's, OSError, ValueError for a server without range requests).
    """
    try:
        yield
    except StepbundleError:
        raise
    except FileNotFoundError as e:
        typed = classify(url, e, pace)
        if typed is None:
            raise
        raise typed from None
    except Exception as e:
        typed = classify(url, e, pace)
        if typed is not None:
            raise typed from None
        cause = f"{type(e).__name__}: {e}"
        raise RemoteError(f"Could not {doing} {url!r}: {cause}", url, cause) from None


def read_object(url: str) -> bytes:
    """The whole object at ``url`` (small objects: compile-cache entries).

    Raises:
      FileNotFoundError: there is no object at ``url``.
      RemoteError: it could not be read.
    """
    fs, path = filesystem(url)
    with failures(url, "read"):
        data = fs.cat_file(path)
    return bytes(data)


class SequentialReader:
    """An object read front to back, each ``read(n)`` one ranged request for ``n`` bytes
    (no read-ahead: a download that stops after the header fetches no more).

    An HTTP server that ignores range requests (Python's ``http.server``, some static
    servers) answers the first read from the start of the object, and fsspec refuses
    the next one with a ``ValueError``; the reader then switches to one streamed
    request and skips to where it was. Such a server sends the object from its start,
    so a refusal after the header and manifest stops a transfer already under way.

    The whole read is held to ``pace``'s minimum average rate: on HTTP every request is
    given the time its bytes may take (``TransferPace.time_for``) as aiohttp's total
    timeout, so a server that trickles bytes is cut off on time; on other backends the
    rate is checked between reads. Too slow, a read raises ``RemoteRefusedError``.
    """

    def __init__(self, fs: Any, path: str, pace: TransferPace) -> None:
        self._fs, self._path, self._pace = fs, path, pace
        self._http = "http" in fs.protocol
        self._pos = 0
        self._size: int | None = None
        self._streaming = False
        # The first request (fsspec's HEAD for the size, or its GET) must answer within
        # the response timeout: a server dripping its headers a byte at a time restarts
        # the session's 60 s per-read limit with every byte. (fsspec's sync() takes a
        # timeout= of its own: the limit goes to the request, as aiohttp's total.)
        self._pace.check()
        first: dict[str, Any] = {}
        if self._http:
            size = _first_answer(fs, path, pace.url)
            if size is not None:
                first["size"] = size  # fsspec then asks no more
        self._f = fs.open(path, "rb", block_size=CHUNK, cache_type="none", **first)
        self._size = getattr(self._f, "size", None)

    def _limits(self, n: int) -> dict[str, Any]:
        """The request options that give a request for ``n`` bytes the time they may take."""
        if self._size is not None:
            n = max(0, min(n, self._size - self._pos))
        seconds = self._pace.time_for(n)
        if not self._http:
            return {}
        import aiohttp

        return {"timeout": aiohttp.ClientTimeout(total=seconds, sock_read=READ_TIMEOUT_S)}

    @property
    def declared_size(self) -> int | None:
        """The object's size as the server declared it (Content-Length), if it did."""
        size = getattr(self._f, "size", None)
        if size is None:  # a streamed HTTP response: its own Content-Length
            size = getattr(getattr(self._f, "r", None), "content_length", None)
        return int(size) if size is not None else None

    def read(self, n: int) -> bytes:
        try:
            if not self._streaming and hasattr(self._f, "kwargs"):
                self._f.kwargs.update(self._limits(n))  # fsspec's HTTPFile: per request
            else:
                self._pace.check()
            try:
                data = bytes(self._f.read(n))
            except ValueError:
                if self._streaming or not self._http:
                    raise
                self._stream()
                data = bytes(self._f.read(n))
        except StepbundleError:
            raise
        except Exception:
            if self._pace.too_slow():
                raise self._pace.error() from None
            raise
        self._pos += len(data)
        self._pace.count(len(data))
        return data

    def _stream(self) -> None:
        with contextlib.suppress(Exception):
            self._f.close()
        # With size= given fsspec skips its HEAD, and hands timeout= to the one GET.
        size = getattr(self._f, "size", None) or 1
        # One request for the whole object, from its start: it gets the time all of it
        # may take, and the bytes skipped again count as bytes that came.
        pos, self._pos = self._pos, 0
        self._f = self._fs.open(self._path, "rb", block_size=0, size=size, **self._limits(size))
        self._streaming = True
        left = pos
        while left:
            skipped = len(self._f.read(min(left, CHUNK)))
            if not skipped:
                break
            self._pace.count(skipped)
            self._pace.check()
            left -= skipped
        self._pos = pos

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._f.close()


def _first_answer(fs: Any, path: str, url: str) -> int | None:
    """The size of an HTTP object from fsspec's first request (a HEAD, or a GET where
    that fails), which must answer within ``response_timeout_s()``.

    fsspec's synchronous calls take ``timeout=`` as their own wait and never hand it to
    the request, so the request runs here on fsspec's loop with aiohttp's total timeout.

    Raises:
      RemoteRefusedError: no answer in time (a server dripping its headers).
      The backend's own errors otherwise (wrapped by ``failures``).
    """
    import asyncio

    import aiohttp

    answer_s = response_timeout_s()
    limit = aiohttp.ClientTimeout(total=answer_s, sock_read=READ_TIMEOUT_S)
    t0 = time.monotonic()
    future = asyncio.run_coroutine_threadsafe(fs._info(path, timeout=limit), fs.loop)
    try:
        info = future.result(timeout=2 * answer_s + 5)  # a HEAD, then a GET: each bounded
    except Exception as e:
        future.cancel()
        if time.monotonic() - t0 >= answer_s and _timed_out(e):
            raise response_timeout_error(url, answer_s, f"{type(e).__name__}: {e}") from None
        raise
    size = info.get("size")
    return int(size) if size is not None and info.get("partial", True) else None


def _timed_out(e: BaseException) -> bool:
    """Whether a timeout is in ``e``'s chain (fsspec wraps a failed HEAD and GET in
    ``FileNotFoundError``)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, TimeoutError):  # asyncio's and aiohttp's are TimeoutErrors
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


@contextlib.contextmanager
def reading(url: str, pace: TransferPace | None = None) -> Iterator[SequentialReader]:
    """``url`` opened for reading front to back (``SequentialReader``), the whole transfer
    held to ``pace`` (default: the minimum rate of ``$STEPBUNDLE_MIN_TRANSFER_RATE``
    after ``$STEPBUNDLE_TRANSFER_GRACE_S``, from now).

    Reads raise the backend's own errors (or ``RemoteRefusedError``); wrap them in
    ``failures``.
    """
    pace = pace or TransferPace(url)
    fs, path = filesystem(url)
    with failures(url, "open", pace):
        f = SequentialReader(fs, path, pace)
    try:
        yield f
    finally:
        f.close()


def _temp_name(path: str) -> str:
    parent, _, name = path.rpartition("/")
    temp = f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    return f"{parent}/{temp}" if parent else temp


def write_object(url: str, content: WriteFn | Chunks) -> None:
    """Write the object at ``url`` so that readers see the old object or the whole new one.

    The content goes to a temporary object in the same folder, which is then moved onto
    ``url``; on any failure the temporary object is removed and ``url`` is untouched.

    Raises:
      RemoteError: the object could not be written (or the scheme cannot write).
      Whatever ``content`` raises.
    """
    check_can_write(url)
    fs, path = filesystem(url)
    temp = _temp_name(path)
    try:
        with failures(url, "write"):
            try:
                f = fs.open(temp, "wb")
            except FileNotFoundError:
                # A file system with real folders (sftp, a share): make them. Object
                # stores never get here, so no bucket is ever created by accident.
                fs.makedirs(path.rpartition("/")[0], exist_ok=True)
                f = fs.open(temp, "wb")
        with failures(url, "write"), f:
            if callable(content):
                content(f)
            else:
                for chunk in content:
                    f.write(chunk)
        with failures(url, "move the finished upload onto"):
            fs.mv(temp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm_file(temp)
        raise


@contextlib.contextmanager
def downloaded(url: str, suffix: str = "", max_bytes: int | None = None) -> Iterator[Path]:
    """A local copy of the object at ``url`` in the system's temporary folder (``$TMPDIR``),
    removed afterwards: for readers that need a local file (memory maps).

    At most ``max_bytes`` (default ``$STEPBUNDLE_MAX_DOWNLOAD_BYTES``, 64 GiB) are
    written: a declared Content-Length above it is refused before any body is read, and
    a body that grows past it, or past the length it declared, is cut off. The copy is
    removed on every failure.

    Raises:
      FileNotFoundError: there is no object at ``url``.
      RemoteRefusedError: it is (or claims to be) larger than ``max_bytes``, or sent more
        than it declared, or the transfer went too slowly.
      RemoteError: it could not be read.
    """
    limit = max_download_bytes() if max_bytes is None else max_bytes
    fd, name = tempfile.mkstemp(prefix=".stepbundle-download-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as out, reading(url) as f:
            declared = f.declared_size
            if declared is not None and declared > limit:
                raise _too_large(url, f"declares {declared} bytes", limit)
            got = 0
            while True:
                with failures(url, "download"):
                    chunk = f.read(CHUNK)
                if not chunk:
                    break
                got += len(chunk)
                if got > limit:
                    raise _too_large(url, "kept sending past the limit", limit)
                if declared is not None and got > declared:
                    raise RemoteRefusedError(
                        f"{url!r} sent more than the {declared} bytes it declared (its "
                        "Content-Length): the server is broken or hostile. The download was "
                        "stopped and removed; fix the server or copy the file another way.",
                        url,
                    )
                out.write(chunk)
        yield Path(name)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def _too_large(url: str, what: str, limit: int) -> RemoteRefusedError:
    return RemoteRefusedError(
        f"{url!r} {what}: a download may take at most {limit} bytes here, so this is not "
        "the checkpoint expected (or the server is hostile). The download was stopped and "
        "removed. Check the URL; for a checkpoint really this large, raise the limit with "
        "STEPBUNDLE_MAX_DOWNLOAD_BYTES=BYTES.",
        url,
    )


def check_can_write(url: str) -> None:
    """Refuse a URL whose scheme can only be read (``http://``, ``https://``).

    Raises:
      RemoteError: nothing can be written at ``url``.
    """
    if url.split("://", 1)[0].lower() in ("http", "https"):
        raise RemoteError(
            f"{url!r} cannot be written: http(s) URLs are read-only here. Checkpoints and "
            "other outputs need a writable local path or an object-store URL (gs://, "
            "s3://, az://, ... with its fsspec backend installed).",
            url,
        )


def list_names(url: str, pattern: str) -> list[str]:
    """Names of the objects in the folder ``url`` that match the glob ``pattern``, sorted."""
    fs, path = filesystem(url)
    with failures(url, "list"):
        found = fs.glob(path.rstrip("/") + "/" + pattern)
    return sorted(str(p).rstrip("/").rpartition("/")[2] for p in found)


def check_writable(url: str) -> None:
    """Prove that objects can be written into the folder ``url`` (credentials, scheme)
    by writing and removing a small one, before a run spends hours to find out.

    Raises:
      RemoteError: nothing can be written there.
    """
    probe = join(url, f".stepbundle-probe-{socket.gethostname()}-{os.getpid()}")
    write_object(probe, [b"stepbundle write probe\n"])
    fs, path = filesystem(probe)
    with failures(probe, "remove the write probe"):
        fs.rm_file(path)
