"""Attacks on the URL and store surfaces (issue #29, items 6, 7, 10, 11, 12, 16, 17, 18,
19): each performs the attack for real and raises AssertionError unless the outcome is
the clean refusal (or the correct result).

``attacks()`` lists them as ``(name, function)``; each function takes an empty
temporary folder. Servers are ``HostileServer`` (tests/runtime/remote_helpers.py) on
127.0.0.1, stopped at the end of each attack; commands run as
``sys.executable -m stepbundle ...`` in child processes with a time limit.

Imports: the standard library, stepbundle, the tests' remote_helpers (fsspec).
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from remote_helpers import HostileServer  # noqa: E402

GOLDEN = max(
    (ROOT / "tests" / "golden").glob("v*/linear_adamw.stepbundle"),
    key=lambda p: tuple(int(n) for n in p.parent.name[1:].split(".")),
)
TIME_LIMIT_S = 20.0


def _bundle() -> tuple[bytes, int, str]:
    data = GOLDEN.read_bytes()
    end = 64 + struct.unpack_from("<Q", data, 16)[0]
    return data, end, "sha256:" + hashlib.sha256(data[:end]).hexdigest()


def _cli(
    tmp: Path, *argv: str, env: dict[str, str] | None = None, **kw: object
) -> subprocess.CompletedProcess[str]:
    full = {"STEPBUNDLE_CACHE_DIR": str(tmp / "cache"), "TMPDIR": str(tmp), **(env or {})}
    try:
        return subprocess.run(
            [sys.executable, "-m", "stepbundle", *argv],
            env={**os.environ, **full},
            capture_output=True,
            text=True,
            timeout=TIME_LIMIT_S,
            **kw,  # type: ignore[call-overload]
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"stepbundle {' '.join(argv)} still ran after {TIME_LIMIT_S} s"
        ) from None


def _refused(done: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    err = done.stderr
    if done.returncode != code or "Traceback" in err:
        raise AssertionError(
            f"expected a refusal with exit {code}, got {done.returncode}: {err[-800:]}"
        )
    for w in words:
        if w not in err:
            raise AssertionError(f"the refusal does not say {w!r}: {err[-800:]}")


def _npz(tmp: Path) -> Path:
    """The golden inputs: one (S, *shape) array per batch input, as --data takes."""
    return GOLDEN.with_name("linear_adamw.inputs.npz")


# The minimum-rate check made quick: a 1 s grace period, then 20000 bytes/s.
FAST_PACE = {"STEPBUNDLE_TRANSFER_GRACE_S": "1", "STEPBUNDLE_MIN_TRANSFER_RATE": "20000"}


def trickle_rate(tmp: Path) -> None:
    """6: a server sending a byte every 0.2 s is cut off once, past the grace period,
    its average rate is below the minimum."""
    data, _, _ = _bundle()
    with HostileServer(objects={"b": data}, interval=0.2) as s:
        url = f"{s.url}/trickle/b"
        done = _cli(tmp, "pull", url, env=FAST_PACE)
    _refused(done, 1, url, "went too slowly", "STEPBUNDLE_MIN_TRANSFER_RATE")


def slow_but_steady(tmp: Path) -> None:
    """6 (review, 9): a download slower than a whole-transfer deadline, but above the
    minimum rate, finishes (5 KB/s against 2000 bytes/s, several grace periods)."""
    data, _, digest = _bundle()
    env = {"STEPBUNDLE_TRANSFER_GRACE_S": "1", "STEPBUNDLE_MIN_TRANSFER_RATE": "2000"}
    env["STEPBUNDLE_TRANSFER_DEADLINE_S"] = "2"  # the old limit: now ignored, with a warning
    with HostileServer(objects={"b": data}, interval=0.1, step_bytes=500) as s:
        t0 = time.monotonic()
        done = _cli(tmp, "pull", f"{s.url}/trickle/b", env=env)
    _refused(done, 0, "STEPBUNDLE_TRANSFER_DEADLINE_S is ignored")
    if time.monotonic() - t0 < 2 or digest not in done.stdout:
        raise AssertionError(f"expected a pull of {digest} over more than 2 s: {done.stdout}")


def fifo_inputs(tmp: Path) -> None:
    """7: a named pipe as any input or output path is refused without being opened."""
    fifo = tmp / "pipe"
    os.mkfifo(fifo)
    npz = _npz(tmp)
    base = ["run", str(GOLDEN), "--steps", "1", "--no-cache"]
    cases = {
        "the bundle": ["run", str(fifo), "--steps", "1", "--data", str(npz)],
        "--data": [*base, "--data", str(fifo)],
        "--resume": [*base, "--data", str(npz), "--resume", str(fifo)],
        "--init-from": [*base, "--data", str(npz), "--init-from", str(fifo)],
        "--metrics-file": [*base, "--data", str(npz), "--metrics-file", str(fifo)],
        "--eval-data": [*base, "--data", str(npz), "--eval-data", str(fifo), "--eval-every", "1"],
    }
    for flag, argv in cases.items():
        _refused(_cli(tmp, *argv), 2, f"{flag} {str(fifo)!r} is a named pipe (FIFO)")


def full_store(tmp: Path) -> None:
    """10: a store on a full disk is a typed error naming the folder, and leaves nothing."""
    data, _, _ = _bundle()
    disk = tmp / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]
    mounted = subprocess.run(mount, capture_output=True).returncode == 0

    def limit() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    try:
        if mounted:
            (disk / "filler").write_bytes(b"\0" * (48 << 10))
        store = disk / "cache" / "bundles"
        run = ["run", "--steps", "1", "--data", str(_npz(tmp)), "--no-cache"]
        with HostileServer(objects={"b": data}) as s:
            for argv in (["pull", f"{s.url}/ok/b"], [*run, f"{s.url}/ok/b"]):
                done = _cli(
                    tmp,
                    *argv,
                    env={"STEPBUNDLE_CACHE_DIR": str(disk / "cache")},
                    preexec_fn=None if mounted else limit,
                )
                _refused(done, 1, str(store), f"needs {len(data)} bytes", "STEPBUNDLE_CACHE_DIR")
                if list(store.iterdir()):
                    raise AssertionError(f"a full store kept files: {list(store.iterdir())}")
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)


def malformed_digest(tmp: Path) -> None:
    """11: ``run sha256:ABCDEF`` is refused with the expected form."""
    done = _cli(tmp, "run", "sha256:ABCDEF", "--steps", "1", "--data", str(_npz(tmp)))
    _refused(done, 2, "is not a bundle digest", "64 hex digits")


def cache_dir_is_a_file(tmp: Path) -> None:
    """12: STEPBUNDLE_CACHE_DIR naming a file is refused clearly."""
    data, _, _ = _bundle()
    afile = tmp / "afile"
    afile.write_text("x")
    env = {"STEPBUNDLE_CACHE_DIR": str(afile)}
    run = ["run", "--steps", "1", "--data", str(_npz(tmp)), "--no-cache"]
    with HostileServer(objects={"b": data}) as s:
        for argv in (["pull", f"{s.url}/ok/b"], [*run, f"{s.url}/ok/b"]):
            done = _cli(tmp, *argv, env=env)
            _refused(done, 1, "is a file, not a folder", "STEPBUNDLE_CACHE_DIR")


def damaged_entry(tmp: Path) -> None:
    """16: an entry damaged after its header is fetched again by pull."""
    data, _, digest = _bundle()
    with HostileServer(objects={"b": data}) as s:
        url = f"{s.url}/ok/b"
        first = _cli(tmp, "pull", url)
        _refused(first, 0)
        entry = Path(first.stdout.split()[1])
        damaged = bytearray(data)
        damaged[-5] ^= 1
        entry.write_bytes(bytes(damaged))
        again = _cli(tmp, "pull", url, "--expect-digest", digest)
    _refused(again, 0, "fetched")
    if entry.read_bytes() != data:
        raise AssertionError("the damaged store entry was not replaced by a fresh fetch")


def http_statuses(tmp: Path) -> None:
    """17: 401/403/500/redirect loops name the real cause; --resume names the URL; an
    http(s) --checkpoint-dir is refused up front."""
    expected = {
        "status/401": "Access denied (HTTP 401)",
        "status/403": "Access denied (HTTP 403)",
        "status/500": "Server error (HTTP 500)",
        "loop": "Too many redirects",
    }
    npz = _npz(tmp)
    with HostileServer(objects={"garbage": b"\xff" * 4096}) as s:
        for path, words in expected.items():
            _refused(_cli(tmp, "pull", f"{s.url}/{path}"), 1, words, f"{s.url}/{path}")
        run = ["run", str(GOLDEN), "--steps", "1", "--data", str(npz), "--no-cache"]
        resumed = _cli(tmp, *run, "--resume", f"{s.url}/ok/garbage")
        _refused(resumed, 1, f"{s.url}/ok/garbage")
        if ".stepbundle-download-" in resumed.stderr:
            raise AssertionError(f"--resume names a temporary file: {resumed.stderr[-500:]}")
        ckpt = _cli(tmp, *run, "--checkpoint-dir", f"{s.url}/ckpt/")
    _refused(ckpt, 2, "checkpoints need a writable local path or object-store URL")


def download_size_limit(tmp: Path) -> None:
    """18: endless and over-declared --resume downloads are cut off, the temp file removed."""
    npz = _npz(tmp)
    run = ["run", str(GOLDEN), "--steps", "1", "--data", str(npz), "--no-cache"]
    env = {"STEPBUNDLE_MAX_DOWNLOAD_BYTES": str(1 << 20)}
    with HostileServer() as s:
        for path in ("endless", "huge"):
            done = _cli(tmp, *run, "--resume", f"{s.url}/{path}", env=env)
            _refused(done, 1, f"{s.url}/{path}", "STEPBUNDLE_MAX_DOWNLOAD_BYTES")
        sent = s.body_bytes
    left = list(tmp.glob(".stepbundle-*"))
    if left or sent > 64 << 20:
        raise AssertionError(f"left {left} in TMPDIR; the server sent {sent} bytes")


def killed_pull(tmp: Path) -> None:
    """19: a pull killed part way leaves a temp file; the next pull keeps it while it may
    be a live pull's (the store has no lock; a process id says nothing across PID
    namespaces), and removes it once a day old."""
    data, end, _ = _bundle()
    store = tmp / "cache" / "bundles"
    with HostileServer(objects={"b": data}, interval=0.05, fast_bytes=end + 100) as s:
        env = {**os.environ, "STEPBUNDLE_CACHE_DIR": str(tmp / "cache")}
        child = subprocess.Popen(
            [sys.executable, "-m", "stepbundle", "pull", f"{s.url}/trickle/b"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            until = time.monotonic() + 15
            while not list(store.glob(".sha256-*")) and time.monotonic() < until:
                time.sleep(0.05)
        finally:
            child.kill()
            child.wait()
        temps = list(store.glob(".sha256-*"))
        if not temps:
            raise AssertionError("the pull never began writing its temp file")
        done = _cli(tmp, "pull", f"{s.url}/ok/b")
        _refused(done, 0)
        entry = Path(done.stdout.split()[1]).name
        names = sorted(p.name for p in store.iterdir())
        if names != sorted([entry, temps[0].name]):
            raise AssertionError(f"the store holds {names}: a fresh temp file was removed")
        day_old = time.time() - 2 * 24 * 3600
        os.utime(temps[0], (day_old, day_old))
        _refused(_cli(tmp, "pull", f"{s.url}/ok/b"), 0)
    names = sorted(p.name for p in store.iterdir())
    if names != [entry]:
        raise AssertionError(f"the store holds {names} after a pull with a day-old temp file")


def attacks() -> list[tuple[str, Callable[[Path], None]]]:
    """Every attack of this surface, by name."""
    return [
        ("6 trickling server falls below the minimum rate", trickle_rate),
        ("6 slow but steady download finishes", slow_but_steady),
        ("7 named pipes as inputs and outputs", fifo_inputs),
        ("10 store on a full disk", full_store),
        ("11 malformed sha256 digest", malformed_digest),
        ("12 STEPBUNDLE_CACHE_DIR is a file", cache_dir_is_a_file),
        ("16 store entry damaged after its header", damaged_entry),
        ("17 HTTP statuses, --resume URL, http --checkpoint-dir", http_statuses),
        ("18 download size limits", download_size_limit),
        ("19 killed pull's temp file goes once a day old", killed_pull),
    ]


if __name__ == "__main__":  # a quick manual run; the project's runner is scripts/attacks.py
    import tempfile

    for name, attack in attacks():
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as d:
            try:
                attack(Path(d))
                print(f"ok    {name} ({time.monotonic() - t0:.1f}s)")
            except AssertionError as e:
                print(f"FAIL  {name} ({time.monotonic() - t0:.1f}s): {e}")
