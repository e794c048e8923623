"""Hostile servers, pipes and full disks on the URL and store surfaces (issue #29, round
three): each ends in a typed refusal in whole sentences, or in the right result.

Everything is real: HTTP servers on 127.0.0.1 that trickle, refuse, loop or never stop
(``HostileServer``), named pipes made with ``os.mkfifo``, a tmpfs of a few pages (or,
where mounting is not allowed, a child process under ``RLIMIT_FSIZE``), and processes
killed with SIGKILL part way through a pull.
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from remote_helpers import HostileServer
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.cli.main import main
from stepbundle.runtime.errors import CheckpointError
from stepbundle.runtime.io import remote
from stepbundle.runtime.io.store import (
    STALE_TEMP_AGE_S,
    NotInStoreError,
    pull,
    resolve_bundle,
    stored_path,
)
from stepbundle.runtime.state.checkpoint import read_checkpoint
from stepbundle.schema.errors import BundleError

NAME = "linear_adamw"
DATA = golden_bundle(NAME).read_bytes()
MANIFEST_END = 64 + struct.unpack_from("<Q", DATA, 16)[0]
DIGEST = "sha256:" + hashlib.sha256(DATA[:MANIFEST_END]).hexdigest()


@pytest.fixture
def server() -> Iterator[HostileServer]:
    with HostileServer(objects={"b.stepbundle": DATA}) as s:
        yield s


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STEPBUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla")


@pytest.fixture
def npz(tmp_path: Path) -> Path:
    batches = golden_batches(NAME)
    path = tmp_path / "d.npz"
    np.savez(path, **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    return path


def _cli(*argv: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepbundle", *argv],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Issue #29, 6 (and its review, 9): a minimum average rate, not a whole deadline
# A trickle is stopped within about a second; 5 KB/s passes the slow check.
FAST_CHECKS = {"STEPBUNDLE_TRANSFER_GRACE_S": "1", "STEPBUNDLE_MIN_TRANSFER_RATE": "20000"}
SLOW_CHECKS = {"STEPBUNDLE_TRANSFER_GRACE_S": "1", "STEPBUNDLE_MIN_TRANSFER_RATE": "2000"}


def test_a_trickling_server_is_cut_off_below_the_minimum_rate(
    server: HostileServer, cache: Path
) -> None:
    """One byte every 0.2 s never trips aiohttp's per-read limit; the minimum average
    rate ends it once the grace period is over, naming the URL and the rate."""
    url = f"{server.url}/trickle/b.stepbundle"
    t0 = time.monotonic()
    done = _cli("pull", url, env=FAST_CHECKS, timeout=25)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - t0 < 20
    assert url in done.stderr and "went too slowly" in done.stderr, done.stderr
    assert "below the minimum average of 20000 bytes/s" in done.stderr, done.stderr
    assert "STEPBUNDLE_MIN_TRANSFER_RATE" in done.stderr and "Traceback" not in done.stderr
    assert not list((cache / "bundles").glob("*"))  # nothing entered the store


def test_a_slow_steady_download_is_not_cut_off(server: HostileServer, cache: Path) -> None:
    """About 5 KB/s, above the 2000 bytes/s minimum: the pull takes several grace
    periods and finishes. The old whole-transfer deadline, set here shorter than the
    pull, stopped it (as 3600 s stopped every download longer than an hour); it is now
    ignored, with a warning that names what replaced it."""
    server.step_bytes, server.interval = 500, 0.1
    url = f"{server.url}/trickle/b.stepbundle"
    t0 = time.monotonic()
    env = {**SLOW_CHECKS, "STEPBUNDLE_TRANSFER_DEADLINE_S": "2"}
    done = _cli("pull", url, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "STEPBUNDLE_TRANSFER_DEADLINE_S is ignored" in done.stderr, done.stderr
    assert time.monotonic() - t0 > 2 * float(SLOW_CHECKS["STEPBUNDLE_TRANSFER_GRACE_S"])
    assert stored_path(DIGEST).exists()


def test_a_trickling_checkpoint_download_is_cut_off(
    server: HostileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in FAST_CHECKS.items():
        monkeypatch.setenv(name, value)
    url = f"{server.url}/trickle/b.stepbundle"
    with pytest.raises(CheckpointError, match="went too slowly") as e:
        read_checkpoint(url)
    assert url in str(e.value)


def test_the_rate_rule_lets_a_long_fast_download_finish_and_stops_a_trickle() -> None:
    """At the defaults (64 KiB/s after 60 s): 20 GB at 3 MB/s takes almost two hours
    and is never stopped (the old 3600 s deadline stopped it every time); a byte every
    30 s is stopped at the first check after the grace period."""
    now = [0.0]
    pace = remote.TransferPace("https://x/big", clock=lambda: now[0])
    assert (pace.min_rate, pace.grace_s) == (64 << 10, 60.0)
    while pace.done < 20e9:
        now[0] += 10.0
        pace.count(30_000_000)
        pace.check()
    assert now[0] > 3600
    # A request for the next 8 MiB at the limit may take until the average would fall
    # below the minimum, never less than a second.
    assert pace.time_for(8 << 20) == pytest.approx((pace.done + (8 << 20)) / (64 << 10) - now[0])
    now[0] = 0.0
    trickle = remote.TransferPace("https://x/trickle", clock=lambda: now[0])
    while not trickle.too_slow():
        assert now[0] <= 60.0, "a trickle is stopped when the grace period ends"
        now[0] += 30.0
        trickle.count(1)
    with pytest.raises(remote.RemoteError, match="went too slowly: 3 bytes in 90.0 s"):
        trickle.check()


# Issue #29, 7: pipes
FIFO_FLAGS = ["bundle", "--data", "--resume", "--init-from", "--metrics-file", "--eval-data"]


@pytest.mark.parametrize("flag", FIFO_FLAGS)
def test_a_named_pipe_is_refused_without_opening_it(
    flag: str,
    tmp_path: Path,
    npz: Path,
    xla_cache: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    args = {"bundle": str(golden_bundle(NAME)), "--data": str(npz)}
    args[flag] = str(fifo)
    argv = ["run", args.pop("bundle"), "--steps", "1", "--cache-dir", str(xla_cache)]
    if flag == "--eval-data":
        argv += ["--eval-every", "1"]
    for k, v in args.items():
        argv += [k, v]

    def blocked(signum: int, frame: object) -> None:
        raise TimeoutError(f"stepbundle run blocked on the FIFO given as {flag}")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)
    try:
        code = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    assert code == 2, err
    name = "the bundle" if flag == "bundle" else flag
    assert f"{name} {str(fifo)!r} is a named pipe (FIFO)" in err, err


def test_eval_and_pull_refuse_pipes_too(
    tmp_path: Path, npz: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert main(["eval", str(golden_bundle(NAME)), "--data", str(fifo)]) == 2
    assert main(["pull", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert err.count("is a named pipe (FIFO)") == 2, err


@pytest.mark.parametrize("where", ["--data", "--eval-data", "--init-from"])
def test_a_named_pipe_inside_a_folder_is_named_as_one(
    where: str,
    tmp_path: Path,
    npz: Path,
    xla_cache: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: a FIFO dataset.json was "has no dataset.json", and a FIFO
    model.safetensors in an --init-from folder "holds neither ... (safetensors files
    there: model.safetensors)"."""
    folder = tmp_path / "folder"
    folder.mkdir()
    name = "model.safetensors" if where == "--init-from" else "dataset.json"
    os.mkfifo(folder / name)
    argv = ["run", str(golden_bundle(NAME)), "--steps", "1", "--cache-dir", str(xla_cache)]
    if where == "--data":
        argv += ["--data", str(folder)]
    else:
        argv += ["--data", str(npz), where, str(folder)]
    if where == "--eval-data":
        argv += ["--eval-every", "1"]

    def blocked(signum: int, frame: object) -> None:
        raise TimeoutError(f"stepbundle run blocked on the FIFO in {where}")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)
    try:
        code = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    assert code in (1, 2), err
    if where == "--init-from":
        assert f"holds {name}, but it is a named pipe (FIFO), not a regular file" in err, err
    else:
        assert f"its {name} is a named pipe (FIFO), not a regular file" in err, err
        assert "has no dataset.json" not in err


# Issue #29, 10: a full store
def _small_filesystem(folder: Path) -> bool:
    """Mount a tmpfs of 64 KiB at ``folder``; False where mounting is not allowed."""
    folder.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True
    )
    return done.returncode == 0


@pytest.mark.parametrize("how", ["tmpfs", "rlimit"])
def test_a_full_store_is_a_typed_error_and_leaves_nothing(
    how: str, server: HostileServer, tmp_path: Path, npz: Path
) -> None:
    disk = tmp_path / "disk"
    mounted = how == "tmpfs" and _small_filesystem(disk)
    if how == "tmpfs" and mounted:
        (disk / "filler").write_bytes(b"\0" * (48 << 10))  # leave less than the bundle
    disk.mkdir(exist_ok=True)

    def limit_file_size() -> None:  # only for "rlimit", or where tmpfs cannot be mounted
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    url = f"{server.url}/ok/b.stepbundle"
    store = disk / "cache" / "bundles"
    try:
        for argv in (["pull", url], ["run", url, "--steps", "1", "--data", str(npz), "--no-cache"]):
            done = subprocess.run(
                [sys.executable, "-m", "stepbundle", *argv],
                env={**os.environ, "STEPBUNDLE_CACHE_DIR": str(disk / "cache")},
                capture_output=True,
                text=True,
                timeout=30,
                preexec_fn=None if mounted else limit_file_size,
            )
            assert done.returncode == 1, done.stderr
            assert "Traceback" not in done.stderr
            assert f"the store {str(store)!r}" in done.stderr, done.stderr
            assert f"needs {len(DATA)} bytes" in done.stderr
            assert "STEPBUNDLE_CACHE_DIR" in done.stderr and "Free space" in done.stderr
            assert list(store.iterdir()) == []  # no entry, no temp file
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)


# Issue #29, 11, 12
def test_a_malformed_digest_is_refused_with_its_form(
    npz: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "sha256:ABCDEF", "--steps", "1", "--data", str(npz)]) == 2
    err = capsys.readouterr().err
    assert "'sha256:ABCDEF' is not a bundle digest" in err, err
    assert "sha256: followed by 64 hex digits" in err
    with pytest.raises(NotInStoreError):  # a digest in capitals is the same digest
        resolve_bundle(DIGEST.upper().replace("SHA256:", "sha256:"))


def test_a_cache_dir_that_is_a_file_is_refused(
    server: HostileServer,
    tmp_path: Path,
    npz: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    monkeypatch.setenv("STEPBUNDLE_CACHE_DIR", str(afile))
    url = f"{server.url}/ok/b.stepbundle"
    assert main(["pull", url]) == 1
    assert main(["run", url, "--steps", "1", "--data", str(npz), "--no-cache"]) == 1
    assert main(["run", DIGEST, "--steps", "1", "--data", str(npz)]) == 2
    err = capsys.readouterr().err
    assert err.count(f"STEPBUNDLE_CACHE_DIR={str(afile)!r}") == 3, err
    assert "is a file, not a folder" in err and "Point STEPBUNDLE_CACHE_DIR at a folder" in err


# Issue #29, 16: damaged entries
def test_an_entry_damaged_after_its_header_is_fetched_again(
    server: HostileServer, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{server.url}/ok/b.stepbundle"
    entry = pull(url, expect_digest=DIGEST).path
    damaged = bytearray(DATA)
    damaged[-5] ^= 0x01  # inside the last section: header and manifest intact
    entry.write_bytes(bytes(damaged))
    assert main(["pull", url]) == 0  # without a pin: the header names the digest
    assert "fetched" in capsys.readouterr().err
    assert entry.read_bytes() == DATA
    entry.write_bytes(bytes(damaged))
    again = pull(url, expect_digest=DIGEST)
    assert again.fetched and entry.read_bytes() == DATA
    entry.write_bytes(bytes(damaged))
    with pytest.raises(NotInStoreError, match="damaged and has been removed"):
        resolve_bundle(DIGEST)
    assert not entry.exists()


# Issue #29, 17: statuses
@pytest.mark.parametrize(
    "path, words",
    [
        ("status/401", "Access denied (HTTP 401)"),
        ("status/403", "Access denied (HTTP 403)"),
        ("status/500", "Server error (HTTP 500)"),
        ("status/503", "Server error (HTTP 503)"),
        ("loop", "Too many redirects"),
    ],
)
def test_http_failures_name_the_real_status(
    path: str, words: str, server: HostileServer, cache: Path
) -> None:
    url = f"{server.url}/{path}"
    with pytest.raises(remote.RemoteError) as e:
        pull(url)
    assert words in str(e.value) and url in str(e.value)
    assert "not found" not in str(e.value)
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(").replace(")", r"\)")):
        read_checkpoint(url)


def test_a_resume_url_error_names_the_url_not_a_temp_file(
    server: HostileServer, npz: Path, xla_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.objects["garbage.safetensors"] = b"\xff" * 4096
    url = f"{server.url}/ok/garbage.safetensors"
    run = ["run", str(golden_bundle(NAME)), "--steps", "1", "--data", str(npz)]
    assert main([*run, "--cache-dir", str(xla_cache), "--resume", url]) == 1
    err = capsys.readouterr().err
    assert url in err and ".stepbundle-download-" not in err, err
    assert tempfile.gettempdir() not in err


def test_an_http_checkpoint_dir_is_refused_up_front(
    server: HostileServer, npz: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["run", str(golden_bundle(NAME)), "--steps", "1", "--data", str(npz)]
    assert main([*run, "--checkpoint-dir", f"{server.url}/ckpt/"]) == 2
    err = capsys.readouterr().err
    assert "checkpoints need a writable local path or object-store URL" in err, err
    with pytest.raises(remote.RemoteError, match="http\\(s\\) URLs are read-only"):
        remote.write_object(f"{server.url}/x.safetensors", [b"x"])


# Issue #29, 18: size limits
@pytest.mark.parametrize("path, words", [("endless", "kept sending"), ("huge", "declares")])
def test_a_download_past_its_limit_is_cut_off_and_removed(
    path: str, words: str, server: HostileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("STEPBUNDLE_MAX_DOWNLOAD_BYTES", str(1 << 20))
    url = f"{server.url}/{path}"
    with pytest.raises(CheckpointError, match=words) as e:
        read_checkpoint(url)
    assert url in str(e.value) and "STEPBUNDLE_MAX_DOWNLOAD_BYTES" in str(e.value)
    assert list(temp.iterdir()) == []  # the partial copy is gone
    assert server.body_bytes < 64 << 20
    if path == "huge":
        assert server.body_bytes <= 1 << 20  # refused on its Content-Length


def test_init_from_a_url_past_the_limit_is_refused(
    server: HostileServer,
    npz: Path,
    xla_cache: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPBUNDLE_MAX_DOWNLOAD_BYTES", str(1 << 20))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run = ["run", str(golden_bundle(NAME)), "--steps", "1", "--data", str(npz)]
    url = f"{server.url}/endless"
    assert main([*run, "--cache-dir", str(xla_cache), "--init-from", url]) == 1
    err = capsys.readouterr().err
    assert url in err and "STEPBUNDLE_MAX_DOWNLOAD_BYTES" in err, err
    assert not list(tmp_path.glob(".stepbundle-*"))


# Issue #29, 19: killed pulls
def test_a_killed_pull_leaves_no_temp_file_behind(server: HostileServer, cache: Path) -> None:
    server.fast_bytes, server.interval = MANIFEST_END + 100, 0.05
    store = cache / "bundles"
    child = subprocess.Popen(
        [sys.executable, "-m", "stepbundle", "pull", f"{server.url}/trickle/b.stepbundle"],
        env={**os.environ},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not list(store.glob(".sha256-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    left = list(store.glob(".sha256-*"))
    assert left, "the pull never started writing"
    with pytest.raises(NotInStoreError):  # a temp file is never an entry
        resolve_bundle(DIGEST)
    # The store has no lock, and a process id says nothing across PID namespaces: a
    # temp file is removed only once a day old (a live pull changes its file far more
    # often), so a fresh one, possibly a live pull's, stays.
    got = pull(f"{server.url}/ok/b.stepbundle")
    assert got.fetched and got.path == stored_path(DIGEST)
    assert sorted(p.name for p in store.iterdir()) == sorted([got.path.name, left[0].name])
    day_old = time.time() - STALE_TEMP_AGE_S - 60
    os.utime(left[0], (day_old, day_old))
    again = pull(f"{server.url}/ok/b.stepbundle")
    assert not again.fetched
    assert sorted(p.name for p in store.iterdir()) == [got.path.name]


def test_transfer_limits_refuse_bad_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPBUNDLE_MIN_TRANSFER_RATE", "slow")
    with pytest.raises(BundleError, match="STEPBUNDLE_MIN_TRANSFER_RATE='slow'"):
        remote.TransferPace("http://127.0.0.1:1/x")
    monkeypatch.delenv("STEPBUNDLE_MIN_TRANSFER_RATE")
    monkeypatch.setenv("STEPBUNDLE_TRANSFER_GRACE_S", "-1")
    with pytest.raises(BundleError, match="STEPBUNDLE_TRANSFER_GRACE_S='-1'"):
        remote.TransferPace("http://127.0.0.1:1/x")
