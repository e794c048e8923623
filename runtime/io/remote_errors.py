"""What went wrong with a URL, in words: ``remote.py``'s two errors and the limits
every transfer is held to.

fsspec's HTTP backend reports nearly every failure of its first request as
``FileNotFoundError(url)`` with the real cause chained behind it (an HTTP 403, a 500, a
redirect loop, a refused connection, a timeout), so "not found" used to be all a user
saw. ``classify`` walks that chain and names the real cause in the message of a
``RemoteRefusedError`` (no caller handles a 403 otherwise than a 500 or a redirect loop,
so one type holds them all); only a 404 (or a missing object on a backend that says so)
stays "not found".

Limits bound every download, each with an environment variable to change it:

- A minimum average rate: once a transfer (a bundle, a checkpoint) has run for
  ``STEPBUNDLE_TRANSFER_GRACE_S`` (default 60) seconds, it is stopped as soon as its
  average since the start falls below ``STEPBUNDLE_MIN_TRANSFER_RATE`` (default 64 KiB/s)
  bytes a second (``TransferPace``). A slow link that keeps going (20 GB at 10 MB/s,
  half an hour and more) finishes; a server sending a byte every 30 seconds, which
  aiohttp's per-read limit never trips, is stopped after the grace period. This replaced
  a whole-transfer deadline of 3600 s (``STEPBUNDLE_TRANSFER_DEADLINE_S``, now ignored
  with a warning), which every download longer than an hour failed, however fast it went.
- No data for 60 s on one read (aiohttp's ``sock_read``) stops an HTTP transfer at once.
- ``STEPBUNDLE_RESPONSE_TIMEOUT_S`` (default 60): the most time an HTTP object's first
  request (its status line and headers) may take. A server that drips its headers a
  byte every few seconds restarted the per-read limit with each byte, and nothing
  bounded the time to the first byte of the body (a pull ran past 240 s; issue #43).
- ``STEPBUNDLE_MAX_DOWNLOAD_BYTES`` (default 64 GiB): the most bytes a download of a
  checkpoint (``--resume``, ``--init-from``) may write to the temporary folder, unless
  its caller knows a tighter bound.

Imports: the standard library, stepbundle.schema; aiohttp (lazily, to recognise its errors).
"""

from __future__ import annotations

import asyncio
import os
import time
import warnings
from collections.abc import Callable

from stepbundle.schema.errors import BundleError

__all__ = [
    "RemoteError",
    "RemoteRefusedError",
    "TransferPace",
    "classify",
    "max_download_bytes",
    "response_timeout_s",
]

MIN_RATE_ENV = "STEPBUNDLE_MIN_TRANSFER_RATE"
DEFAULT_MIN_RATE = 64 << 10  # bytes per second: 64 KiB/s, a poor mobile link
GRACE_ENV = "STEPBUNDLE_TRANSFER_GRACE_S"
DEFAULT_GRACE_S = 60.0  # connection set-up and a slow start never count
READ_TIMEOUT_S = 60.0  # no data for this long on one read stops an HTTP transfer
# Replaced by the minimum rate; remove this name and its warning after 0.3.
OLD_DEADLINE_ENV = "STEPBUNDLE_TRANSFER_DEADLINE_S"
RESPONSE_TIMEOUT_ENV = "STEPBUNDLE_RESPONSE_TIMEOUT_S"
DEFAULT_RESPONSE_TIMEOUT_S = 60.0
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


class RemoteRefusedError(RemoteError):
    """A URL failed for a cause the message names: an HTTP status (401/403, 5xx, ...), a
    transfer too slow or a response too late, a redirect loop or a redirect to a scheme
    that is not followed, a size limit, an fsspec backend that is not installed. A
    caller passes it on as it is, where a plain ``RemoteError`` (a connection that broke)
    in the middle of a download becomes a ``DownloadError`` (``store.py``)."""


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


def response_timeout_s() -> float:
    """The most seconds an HTTP object's first request may take to answer
    (``$STEPBUNDLE_RESPONSE_TIMEOUT_S``, default 60)."""
    return _env_number(RESPONSE_TIMEOUT_ENV, DEFAULT_RESPONSE_TIMEOUT_S)


def response_timeout_error(
    url: str, seconds: float, cause: str | None = None
) -> RemoteRefusedError:
    return RemoteRefusedError(
        f"{url!r} did not send its response within {seconds:g} s (its status line and "
        "headers came too slowly, or not at all): the server is stalled or hostile. Retry "
        f"when it answers; for a server really this slow, raise {RESPONSE_TIMEOUT_ENV}.",
        url,
        cause,
    )


def max_download_bytes() -> int:
    """The most bytes a checkpoint download may hold (``$STEPBUNDLE_MAX_DOWNLOAD_BYTES``,
    default 64 GiB)."""
    return int(_env_number(MAX_BYTES_ENV, DEFAULT_MAX_DOWNLOAD_BYTES))


_warned_old_deadline = False


class TransferPace:
    """One transfer of ``url`` held to a minimum average rate (module docstring).

    The transfer counts its bytes (``count``); ``too_slow()`` says whether, past the
    grace period, the average since the start is below the minimum, and ``check()``
    raises ``RemoteRefusedError`` then. ``time_for(n)`` is how long a request for
    ``n`` more bytes may take: until the moment the average, those bytes included,
    would fall below the minimum (never before the grace period ends). On HTTP each
    request gets that as aiohttp's total timeout, so a trickle inside one request is cut
    off on time too.

    Args:
      url: the URL, for the message.
      min_rate, grace_s: bytes a second and seconds; default
        ``$STEPBUNDLE_MIN_TRANSFER_RATE`` and ``$STEPBUNDLE_TRANSFER_GRACE_S``.
      clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        url: str,
        *,
        min_rate: float | None = None,
        grace_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        global _warned_old_deadline
        if os.environ.get(OLD_DEADLINE_ENV) and not _warned_old_deadline:
            _warned_old_deadline = True
            warnings.warn(
                f"{OLD_DEADLINE_ENV} is ignored: a transfer is no longer held to a whole "
                f"deadline but to a minimum average rate ({MIN_RATE_ENV}, bytes a second, "
                f"default {DEFAULT_MIN_RATE}) after a grace period ({GRACE_ENV}, default "
                f"{DEFAULT_GRACE_S:g} s). Unset it, and set those instead if needed.",
                stacklevel=2,
            )
        self.url = url
        self.min_rate = (
            _env_number(MIN_RATE_ENV, DEFAULT_MIN_RATE) if min_rate is None else min_rate
        )
        self.grace_s = _env_number(GRACE_ENV, DEFAULT_GRACE_S) if grace_s is None else grace_s
        self._clock = clock
        self._start = clock()
        self.done = 0

    def elapsed(self) -> float:
        return self._clock() - self._start

    def count(self, n: int) -> None:
        """Count ``n`` bytes that arrived."""
        self.done += n

    def too_slow(self) -> bool:
        t = self.elapsed()
        return t > self.grace_s and self.done < self.min_rate * t

    def check(self) -> None:
        """Raise ``RemoteRefusedError`` if the transfer is too slow (``too_slow``)."""
        if self.too_slow():
            raise self.error()

    def time_for(self, n: int) -> float:
        """Seconds a request for ``n`` more bytes may take from now (at least one: a
        request needs time to start). Raises ``RemoteRefusedError`` if the transfer
        is too slow already."""
        self.check()
        return max(1.0, max(self.grace_s, (self.done + n) / self.min_rate) - self.elapsed())

    def error(self) -> RemoteRefusedError:
        t = self.elapsed()
        return RemoteRefusedError(
            f"The transfer of {self.url!r} went too slowly: {self.done} bytes in {t:.1f} s, "
            f"below the minimum average of {self.min_rate:g} bytes/s that a transfer must "
            f"keep after its first {self.grace_s:g} s (the server is too slow or stalled). "
            "Retry when it answers faster; for a link really this slow, lower the minimum "
            f"with {MIN_RATE_ENV}=BYTES_PER_SECOND.",
            self.url,
            f"{self.done} bytes in {t:.1f} s, below {self.min_rate:g} bytes/s",
        )


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def classify(url: str, e: BaseException, pace: TransferPace | None = None) -> RemoteError | None:
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
            # aiohttp's ServerTimeoutError is the per-read limit; any other timeout is
            # the total a request was given by the pace (TransferPace.time_for).
            per_read = aiohttp is not None and isinstance(cause, aiohttp.ServerTimeoutError)
            if pace is not None and not per_read and pace.elapsed() >= pace.grace_s:
                return pace.error()
            return RemoteError(
                f"{url!r} stopped answering (no data for {READ_TIMEOUT_S:g} s). Retry when "
                "the server answers, or check the network.",
                url,
                f"{type(cause).__name__}: {cause}",
            )
        if aiohttp is None:
            continue
        if isinstance(
            cause, aiohttp.NonHttpUrlRedirectClientError | aiohttp.InvalidUrlRedirectClientError
        ):
            target = str(cause.args[0]) if cause.args else "?"
            scheme = target.split("://", 1)[0] + "://" if "://" in target else target
            return RemoteRefusedError(
                f"{url!r} redirects to {target!r}, a {scheme} URL, and redirects are "
                "followed only to http:// and https:// (a file:// redirect would read this "
                "machine's files). Use the URL the object is really at.",
                url,
                f"{type(cause).__name__}: {cause}",
            )
        if isinstance(cause, aiohttp.TooManyRedirects):
            return RemoteRefusedError(
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
                error = RemoteRefusedError(
                    f"Access denied (HTTP {status}) to {url!r}: check credentials. The "
                    "server wants credentials this request lacks (a signed URL or token "
                    "that expired, or an object that is not public).",
                    url,
                    f"HTTP {status}",
                )
            elif 500 <= status < 600:
                error = RemoteRefusedError(
                    f"Server error (HTTP {status}) reading {url!r}: the server failed, not "
                    "the request. Retry later, or tell the server's owner.",
                    url,
                    f"HTTP {status}",
                )
            else:
                error = RemoteRefusedError(
                    f"The server refused {url!r} with HTTP {status} ({cause.message}). "
                    "Check the URL.",
                    url,
                    f"HTTP {status}",
                )
            return error
        if isinstance(cause, aiohttp.ClientConnectorError):
            return RemoteError(
                f"Could not reach {url!r} ({type(cause).__name__}: {cause}). Check the "
                "URL and that the server is up.",
                url,
                f"{type(cause).__name__}: {cause}",
            )
    if pace is not None and pace.too_slow():
        return pace.error()
    return None
