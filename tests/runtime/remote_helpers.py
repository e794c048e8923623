"""Places to keep artifacts that are not local paths, for the tests of URLs.

``BundleServer``: a real HTTP server on 127.0.0.1 (``http.server`` in a thread) that
serves byte strings with range requests, as static servers and object stores do, and
counts every request and every body byte it sends. Per object it can also serve a
truncated object, or die part way through a response (the connection is shut after
``n`` bytes of the object, with the full Content-Length promised).

``HostileServer``: one that misbehaves on purpose (trickles, error statuses, redirect
loops, bodies without end), for the refusals of hostile servers.

``FakeObjectStore``: a local folder behind a non-local fsspec file system
(``fakestore://bucket/key``), so the code under test takes its URL paths (its folders
must be made, as on sftp or a share); it can be told to fail a write after some bytes,
as an upload that breaks off does.

Imports: the standard library, fsspec.
"""

from __future__ import annotations

import http.server
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem


@dataclass
class Served:
    """What an object is served as: whole, truncated to ``n`` bytes, or dying after ``n``."""

    data: bytes
    mode: str = "ok"  # "ok", "truncated", "dies"
    n: int = 0


@dataclass
class BundleServer:
    objects: dict[str, Served] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    body_bytes: int = 0
    url: str = ""
    ranges: bool = True  # False: ignore Range headers, as Python's http.server does

    def start(self) -> BundleServer:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, body_too: bool) -> None:
                name = self.path.lstrip("/")
                server.requests.append((self.command, name, self.headers.get("Range")))
                obj = server.objects.get(name)
                if obj is None:
                    self.send_error(404)
                    return
                data = obj.data[: obj.n] if obj.mode == "truncated" else obj.data
                start, end = 0, len(data)
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
                if m and server.ranges:
                    start = int(m[1])
                    end = min(len(data), int(m[2]) + 1) if m[2] else len(data)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(end - start))
                if server.ranges:
                    self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if not body_too:
                    return
                body = data[start:end]
                dies = obj.mode == "dies" and end > obj.n
                if dies:
                    body = body[: max(0, obj.n - start)]
                server.body_bytes += len(body)  # counted first: the client reads after it
                self.wfile.write(body)
                if dies:  # the server goes away mid-response
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            def do_GET(self) -> None:
                self._reply(True)

            def do_HEAD(self) -> None:
                self._reply(False)

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def reset(self) -> None:
        self.requests.clear()
        self.body_bytes = 0
        self.ranges = True

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _FailingWriter:
    """A writable file that raises after ``limit`` bytes, as a broken-off upload does."""

    def __init__(self, f: Any, limit: int) -> None:
        self._f, self._left = f, limit

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self._left:
            self._f.write(memoryview(data).cast("B")[: self._left])
            self._left = 0
            raise ConnectionResetError("the fake object store dropped the upload")
        self._left -= n
        return int(self._f.write(data))

    def __enter__(self) -> _FailingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()

    def close(self) -> None:
        self._f.close()


class FakeObjectStore(DirFileSystem):
    """``fakestore://bucket/key`` -> ``<root>/bucket/key``, through fsspec's non-local path."""

    protocol = "fakestore"
    cachable = False
    root: ClassVar[str] = ""
    fail_writes_after: ClassVar[int | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(path=type(self).root, fs=LocalFileSystem())

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        f = super().open(path, mode, *args, **kwargs)
        limit = type(self).fail_writes_after
        if "w" in mode and limit is not None:
            return _FailingWriter(f, limit)
        return f


fsspec.register_implementation("fakestore", FakeObjectStore, clobber=True)


def fake_store(root: Path) -> Iterator[Path]:
    """Point ``fakestore://`` at ``root`` for one test (use as a generator fixture)."""
    FakeObjectStore.root = str(root)
    FakeObjectStore.fail_writes_after = None
    try:
        yield root
    finally:
        FakeObjectStore.root = ""
        FakeObjectStore.fail_writes_after = None


@dataclass
class HostileServer:
    """A real HTTP server on 127.0.0.1 that misbehaves on purpose, by path:

    - ``/trickle/NAME``: the object ``NAME`` with ranges, the first ``fast_bytes`` of it
      at once and then ``step_bytes`` bytes every ``interval`` seconds (one byte: a
      slowloris sender; more: a slow but steady link);
    - ``/status/CODE``: every request answered with that HTTP status;
    - ``/loop``: a redirect to itself, for ever;
    - ``/endless``: 200 with no Content-Length and bytes without end (up to ``cap``);
    - ``/huge``: a Content-Length of 100 GiB, then bytes without end (up to ``cap``);
    - ``/ok/NAME``: the object whole (with ranges), as ``BundleServer`` serves it;
    - ``/drip``: a status line, then header bytes one every ``interval`` seconds, never
      ending the headers (each byte restarts a per-read timeout);
    - ``/to-file``: a 302 redirect to ``file:///etc/hostname``.

    It counts the body bytes it sent; ``stop`` ends every response in flight.
    """

    objects: dict[str, bytes] = field(default_factory=dict)
    interval: float = 0.2
    fast_bytes: int = 0
    step_bytes: int = 1
    cap: int = 256 << 20
    body_bytes: int = 0
    url: str = ""

    def start(self) -> HostileServer:
        server = self
        self._stopping = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, data: bytes) -> bool:
                try:
                    self.wfile.write(data)
                    self.wfile.flush()
                except OSError:
                    return False
                server.body_bytes += len(data)
                return not server._stopping.is_set()

            def _object(self, name: str, body_too: bool, trickle: bool) -> None:
                data = server.objects.get(name)
                if data is None:
                    self.send_error(404)
                    return
                start, end = 0, len(data)
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
                if m:
                    start = int(m[1])
                    end = min(len(data), int(m[2]) + 1) if m[2] else len(data)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(end - start))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if not body_too:
                    return
                fast_end = end if not trickle else max(start, min(end, server.fast_bytes))
                if fast_end > start and not self._send(data[start:fast_end]):
                    return
                for i in range(fast_end, end, server.step_bytes):
                    piece = data[i : min(end, i + server.step_bytes)]
                    if server._stopping.wait(server.interval) or not self._send(piece):
                        return

            def _endless(self, declared: int | None) -> None:
                self.send_response(200)
                if declared is not None:
                    self.send_header("Content-Length", str(declared))
                self.end_headers()
                if self.command == "HEAD":
                    return
                block = b"\xab" * (64 << 10)
                sent = 0
                while sent < server.cap and self._send(block):
                    sent += len(block)
                self.close_connection = True

            def _drip(self) -> None:
                self.close_connection = True
                if not self._send(b"HTTP/1.1 200 OK\r\nX-Drip: "):
                    return
                while not server._stopping.wait(server.interval) and self._send(b"a"):
                    pass

            def _reply(self) -> None:
                path = self.path.lstrip("/")
                kind, _, rest = path.partition("/")
                if kind == "drip":
                    self._drip()
                elif kind == "to-file":
                    self.send_response(302)
                    self.send_header("Location", "file:///etc/hostname")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif kind == "status":
                    self.send_error(int(rest))
                elif kind == "loop":
                    self.send_response(302)
                    self.send_header("Location", "/loop")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif kind == "endless":
                    self._endless(None)
                elif kind == "huge":
                    self._endless(100 << 30)
                elif kind in ("trickle", "ok"):
                    self._object(rest, self.command == "GET", kind == "trickle")
                else:
                    self.send_error(404)

            do_GET = do_HEAD = _reply

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> HostileServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
