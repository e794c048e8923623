"""What went wrong with a URL, in words: the typed errors of ``remote.py`` and the limits
every transfer is held to.

fsspec's HTTP backend reports nearly every failure of its first request as
``FileNotFoundError(url)`` with the real cause chained behind it (an HTTP 403, a 500, a
redirect loop, a refused connection, a timeout), so "not found" used to be all a user
saw. ``classify`` walks that chain and names the real cause; only a 404 (or a missing
object on a backend that says so) stays "not found".

Two limits bound every download, each with an environment variable to change it:

- ``STEPBUNDLE_TRANSFER_DEADLINE_S`` (default 3600): the seconds one whole transfer
  (a bundle, a checkpoint) may take. aiohttp's own limits are per read, so a server
  sending one byte every 30 seconds was never timed out.
- ``STEPBUNDLE_MAX_DOWNLOAD_BYTES`` (default 64 GiB): the most bytes a download of a
  checkpoint (``--resume``, ``--init-from``) may write to the temporary folder, unless
  its caller knows a tighter bound.

Imports: the standard library, stepbundle.schema; aiohttp (lazily, to recognise its errors).
"""

from __future__ import annotations

import asyncio
import os
import time

from stepbundle.schema.errors import BundleError

__all__ = [
    "AccessDeniedError",
    "BackendMissingError",
    "Deadline",
    "DownloadTooLargeError",
    "HttpStatusError",
    "RemoteError",
    "ServerError",
    "TooManyRedirectsError",
    "TransferTimeoutError",
    "classify",
    "max_download_bytes",
    "transfer_deadline_s",
]

DEADLINE_ENV = "STEPBUNDLE_TRANSFER_DEADLINE_S"
DEFAULT_DEADLINE_S = 3600.0
MAX_BYTES_ENV = "STEPBUNDLE_MAX_DOWNLOAD_BYTES"
DEFAULT_MAX_DOWNLOAD_BYTES = 64 << 30


class RemoteError(BundleError, OSError):
    """A URL could not be read or written: the server, the network, the credentials, or
    a backend failed. The message names the URL and the cause; ``filename`` is the URL,
    ``cause`` the backend's error (``"ClientPayloadError: ..."``) when there was one."""

    def __init__(self, message: str, url: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.filename = url
        self.strerror = message
        self.cause = cause

    def __str__(self) -> str:  # OSError's would prefix "[Errno None]" and append the URL
        return str(self.args[0])


class BackendMissingError(RemoteError):
    """The URL's scheme needs an fsspec backend that is not installed (gcsfs for gs://...)."""


class TransferTimeoutError(RemoteError):
    """A transfer did not finish within the whole-transfer deadline."""


class HttpStatusError(RemoteError):
    """The server answered with an HTTP error status other than 404 (``status``)."""

    status: int = 0


class AccessDeniedError(HttpStatusError):
    """HTTP 401 or 403: the request lacks the credentials the server wants."""


class ServerError(HttpStatusError):
    """HTTP 5xx: the server failed."""


class TooManyRedirectsError(RemoteError):
    """The server redirected again and again (a redirect loop)."""


class DownloadTooLargeError(RemoteError):
    """A download declared or sent more bytes than its limit (or than it declared)."""


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise BundleError(
            f"{name}={text!r} is not a positive finite number. Set it to a number such as "
            f"{default:g}, or unset it for the default ({default:g})."
        )
    return value


def transfer_deadline_s() -> float:
    """Seconds a whole transfer may take (``$STEPBUNDLE_TRANSFER_DEADLINE_S``, default 3600)."""
    return _env_number(DEADLINE_ENV, DEFAULT_DEADLINE_S)


def max_download_bytes() -> int:
    """The most bytes a checkpoint download may hold (``$STEPBUNDLE_MAX_DOWNLOAD_BYTES``,
    default 64 GiB)."""
    return int(_env_number(MAX_BYTES_ENV, DEFAULT_MAX_DOWNLOAD_BYTES))


class Deadline:
    """The end of one transfer of ``url``: ``remaining()`` is the seconds left, and raises
    ``TransferTimeoutError`` once there are none."""

    def __init__(self, url: str, seconds: float | None = None) -> None:
        self.url = url
        self.seconds = transfer_deadline_s() if seconds is None else seconds
        self._end = time.monotonic() + self.seconds

    def expired(self) -> bool:
        return time.monotonic() >= self._end

    def remaining(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise self.error()
        return left

    def error(self) -> TransferTimeoutError:
        return TransferTimeoutError(
            f"The transfer of {self.url!r} did not finish within its deadline of "
            f"{self.seconds:g} s (the server is too slow or stalled). Retry when it answers "
            f"faster; if it is just slow, raise the deadline with {DEADLINE_ENV}=SECONDS.",
            self.url,
            f"deadline of {self.seconds:g} s",
        )


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def classify(url: str, e: BaseException, deadline: Deadline | None = None) -> RemoteError | None:
    """The typed error for a backend's failure ``e`` with ``url``; None when ``e`` only
    says the object is missing (a 404), which callers treat as "none there"."""
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiohttp comes with fsspec's HTTP backend
        aiohttp = None  # type: ignore[assignment]
    for cause in _chain(e):
        if isinstance(cause, RemoteError):
            return cause
        if isinstance(cause, asyncio.TimeoutError | TimeoutError):
            if deadline is not None and deadline.expired():
                return deadline.error()
            return RemoteError(
                f"{url!r} stopped answering (no data for 60 s). Retry when the server "
                "answers, or check the network.",
                url,
                f"{type(cause).__name__}: {cause}",
            )
        if aiohttp is None:
            continue
        if isinstance(cause, aiohttp.TooManyRedirects):
            return TooManyRedirectsError(
                f"Too many redirects reading {url!r}: the server sends the request on in a "
                "loop (or a very long chain). Fix the URL (use where it ends up) or the "
                "server's redirects.",
                url,
                f"{type(cause).__name__}: {cause}",
            )
        if isinstance(cause, aiohttp.ClientResponseError):
            status = cause.status
            if status in (404, 410):
                return None
            if status in (401, 403):
                error: HttpStatusError = AccessDeniedError(
                    f"Access denied (HTTP {status}) to {url!r}: check credentials. The "
                    "server wants credentials this request lacks (a signed URL or token "
                    "that expired, or an object that is not public).",
                    url,
                    f"HTTP {status}",
                )
            elif 500 <= status < 600:
                error = ServerError(
                    f"Server error (HTTP {status}) reading {url!r}: the server failed, not "
                    "the request. Retry later, or tell the server's owner.",
                    url,
                    f"HTTP {status}",
                )
            else:
                error = HttpStatusError(
                    f"The server refused {url!r} with HTTP {status} ({cause.message}). "
                    "Check the URL.",
                    url,
                    f"HTTP {status}",
                )
            error.status = status
            return error
        if isinstance(cause, aiohttp.ClientConnectorError):
            return RemoteError(
                f"Could not reach {url!r} ({type(cause).__name__}: {cause}). Check the "
                "URL and that the server is up.",
                url,
                f"{type(cause).__name__}: {cause}",
            )
    if deadline is not None and deadline.expired():
        return deadline.error()
    return None
