"""Bundles by URL: a real HTTP server on 127.0.0.1, the local bundle store, pinned digests.

The server counts every request and every body byte it sends, so "the store answered",
"refused before the body was downloaded" and "nothing entered the store" are measured,
not assumed. The oracle for a bundle run from a URL is the same bundle loaded from its
local path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from remote_helpers import BundleServer, Served
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.cli.main import main
from stepbundle.runtime import CompileOptions, LoadOptions, SafetyOptions, load
from stepbundle.runtime.io import remote
from stepbundle.runtime.io.store import (
    DigestMismatchError,
    DownloadError,
    NotInStoreError,
    pull,
    stored_path,
)
from stepbundle.schema.errors import BundleFormatError, IntegrityError

NAME = "linear_adamw"
DATA = golden_bundle(NAME).read_bytes()
MANIFEST_END = 64 + struct.unpack_from("<Q", DATA, 16)[0]
# The digest by its definition (FORMAT.md): SHA-256 of the header and the manifest.
DIGEST = "sha256:" + hashlib.sha256(DATA[:MANIFEST_END]).hexdigest()


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile cache for the module: compiling is not what these tests are about."""
    return tmp_path_factory.mktemp("xla")


@pytest.fixture(scope="module")
def want(xla_cache: Path) -> list[float]:
    """The oracle: the bundle's losses, loaded from its local path."""
    return _losses(
        load(
            golden_bundle(NAME),
            options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache, entries="train")),
        )
    )


@pytest.fixture(scope="module")
def server() -> Iterator[BundleServer]:
    s = BundleServer().start()
    yield s
    s.stop()


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: BundleServer) -> Path:
    """A fresh store (and cache folder) per test, and a server serving the bundle whole."""
    monkeypatch.setenv("STEPBUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    server.objects = {"b.stepbundle": Served(DATA)}
    server.reset()
    return tmp_path / "cache" / "bundles"


def _losses(trainer: object, n: int = 3) -> list[float]:
    return [float(m["loss"]) for m in trainer.run(golden_batches(NAME), n)]  # type: ignore[attr-defined]


def _in_store(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir()) if store.exists() else []


def test_a_pinned_url_runs_then_comes_from_the_store(
    server: BundleServer, store: Path, xla_cache: Path, want: list[float]
) -> None:
    url = f"{server.url}/b.stepbundle"
    trainer = load(
        url,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=xla_cache, entries="train"),
            safety=SafetyOptions(expect_digest=DIGEST),
        ),
    )
    assert trainer.digest == DIGEST
    assert _losses(trainer) == want
    assert server.body_bytes == len(DATA)  # the whole file, once
    assert [m for m, _, _ in server.requests].count("GET") >= 3  # header, manifest, body
    entry = stored_path(DIGEST)
    assert entry.read_bytes() == DATA
    assert _in_store(store) == [entry.name]  # nothing else (no temp file) was left

    server.reset()
    again = load(
        url,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=xla_cache, entries="train"),
            safety=SafetyOptions(expect_digest=DIGEST),
        ),
    )
    assert server.requests == []  # the store answered; the server was not asked
    assert _losses(again) == want
    assert (
        _losses(
            load(
                DIGEST,
                options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache, entries="train")),
            )
        )
        == want
    )  # by digest alone

    # Without a pin, the header and manifest name the digest; the body is not fetched again.
    server.reset()
    got = pull(url)
    assert (got.digest, got.fetched, got.bytes_read) == (DIGEST, False, MANIFEST_END)
    assert server.body_bytes == MANIFEST_END


def test_a_wrong_digest_is_refused_before_the_body(server: BundleServer, store: Path) -> None:
    wrong = "sha256:" + "ab" * 32
    with pytest.raises(DigestMismatchError, match="not the expected") as e:
        load(
            f"{server.url}/b.stepbundle",
            options=LoadOptions(
                compile=CompileOptions(cache_dir=False), safety=SafetyOptions(expect_digest=wrong)
            ),
        )
    assert DIGEST in str(e.value) and wrong in str(e.value)
    assert server.body_bytes == MANIFEST_END < len(DATA)  # header and manifest only
    ranges = [r for m, _, r in server.requests if m == "GET"]
    assert ranges == ["bytes=0-63", f"bytes=64-{MANIFEST_END - 1}"]
    assert _in_store(store) == []


@pytest.mark.parametrize("cut", [MANIFEST_END - 100, len(DATA) - 100])
def test_a_truncated_object_never_enters_the_store(
    server: BundleServer, store: Path, cut: int
) -> None:
    server.objects["b.stepbundle"] = Served(DATA, "truncated", cut)
    with pytest.raises(BundleFormatError, match="truncated"):
        pull(f"{server.url}/b.stepbundle")
    assert _in_store(store) == []
    with pytest.raises(NotInStoreError, match="stepbundle pull"):
        load(DIGEST, options=LoadOptions(compile=CompileOptions(cache_dir=False)))


def test_a_server_dying_mid_transfer_is_a_typed_error(
    server: BundleServer, store: Path, xla_cache: Path
) -> None:
    url = f"{server.url}/b.stepbundle"
    server.objects["b.stepbundle"] = Served(DATA, "dies", len(DATA) - 3000)
    with pytest.raises(DownloadError) as e:
        load(
            url,
            options=LoadOptions(
                compile=CompileOptions(cache_dir=xla_cache),
                safety=SafetyOptions(expect_digest=DIGEST),
            ),
        )
    message = str(e.value)
    assert url in message and "stopped after" in message and "Nothing entered the store" in message
    assert isinstance(e.value, OSError) and e.value.filename == url
    assert _in_store(store) == []
    # Once the server answers again, the same call fetches it.
    server.objects["b.stepbundle"] = Served(DATA)
    assert (
        load(
            url,
            options=LoadOptions(
                compile=CompileOptions(cache_dir=xla_cache, entries="train"),
                safety=SafetyOptions(expect_digest=DIGEST),
            ),
        ).digest
        == DIGEST
    )


def test_a_damaged_section_is_caught_before_the_store(server: BundleServer, store: Path) -> None:
    damaged = bytearray(DATA)
    damaged[-5] ^= 0x01  # inside the last section; header and manifest intact
    server.objects["b.stepbundle"] = Served(bytes(damaged))
    with pytest.raises(IntegrityError, match="damaged"):
        pull(f"{server.url}/b.stepbundle", expect_digest=DIGEST)
    assert _in_store(store) == []


def test_a_server_without_range_requests_is_streamed(server: BundleServer, store: Path) -> None:
    server.ranges = False
    got = pull(f"{server.url}/b.stepbundle", expect_digest=DIGEST)
    assert got.fetched and got.path.read_bytes() == DATA
    assert ("GET", "b.stepbundle", None) in server.requests  # one streamed request
    assert _in_store(store) == [got.path.name]


def test_missing_objects_and_backends_say_what_to_do(server: BundleServer, store: Path) -> None:
    with pytest.raises(remote.RemoteError, match="no bundle at .*not found"):
        pull(f"{server.url}/nothing.stepbundle")
    # A scheme whose fsspec backend is not installed here names its package.
    from fsspec.registry import known_implementations

    scheme, package = next(
        (s, str(v["class"]).split(".")[0])
        for s, v in sorted(known_implementations.items())
        if s in ("gs", "s3", "az", "oci", "ocilake")
        and importlib.util.find_spec(str(v["class"]).split(".")[0]) is None
    )
    with pytest.raises(remote.RemoteRefusedError, match=f"pip install {package}"):
        load(
            f"{scheme}://bucket/b.stepbundle",
            options=LoadOptions(compile=CompileOptions(cache_dir=False)),
        )


def test_cli_pull_run_by_digest_and_inspect_a_url(
    server: BundleServer,
    store: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    xla_cache: Path,
    want: list[float],
) -> None:
    url = f"{server.url}/b.stepbundle"
    assert main(["pull", url, "--expect-digest", DIGEST]) == 0
    out = capsys.readouterr().out
    assert out.split() == [DIGEST, str(stored_path(DIGEST))]
    batches = golden_batches(NAME)
    data = tmp_path / "d.npz"
    np.savez(data, **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    server.reset()
    run = ["run", DIGEST, "--steps", "3", "--data", str(data), "--json"]
    assert main([*run, "--cache-dir", str(xla_cache)]) == 0
    assert main(["inspect", url]) == 0
    assert main(["verify", url]) == 0
    out = capsys.readouterr().out
    assert server.body_bytes == 2 * MANIFEST_END  # inspect, verify: header + manifest each
    lines = [line for line in out.splitlines() if line.startswith('{"step"')]
    assert [float(line.split('"loss": ')[1].rstrip("}")) for line in lines] == want
    assert f"digest    {DIGEST}" in out and f"OK {url} {DIGEST}" in out
    assert main(["pull", url, "--expect-digest", "sha256:" + "0" * 64]) == 1
    assert "not the expected" in capsys.readouterr().err


def test_a_store_entry_is_held_to_its_name(
    server: BundleServer, store: Path, xla_cache: Path
) -> None:
    """Another bundle copied over a store entry, or a truncated entry, is never run under
    the entry's digest: the hit is checked, the entry removed, and a pull fetches it again."""
    url = f"{server.url}/b.stepbundle"
    entry = pull(url, expect_digest=DIGEST).path
    entry.write_bytes(golden_bundle("dropout_sgd").read_bytes())  # a valid, other bundle
    with pytest.raises(NotInStoreError, match="damaged and has been removed"):
        load(DIGEST, options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache)))
    assert not entry.exists()
    server.reset()
    again = pull(url, expect_digest=DIGEST)
    assert again.fetched and server.body_bytes == len(DATA)
    entry.write_bytes(DATA[:20000])  # truncated in place
    server.reset()
    assert pull(url, expect_digest=DIGEST).fetched  # fetched again, not "already there"
    assert (
        load(
            DIGEST,
            options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache, entries="train")),
        ).digest
        == DIGEST
    )


def test_cli_resume_a_bundle_given_by_digest(
    server: BundleServer,
    store: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    xla_cache: Path,
) -> None:
    pull(f"{server.url}/b.stepbundle", expect_digest=DIGEST)
    batches = golden_batches(NAME)
    data = tmp_path / "d.npz"
    np.savez(data, **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    common = ["--data", str(data), "--json", "--cache-dir", str(xla_cache)]
    ckpt = tmp_path / "ck"
    assert main(["run", DIGEST, "--steps", "2", "--checkpoint-dir", str(ckpt), *common]) == 0
    resumed = sorted(ckpt.glob("step-*.safetensors"))[-1]
    assert main(["run", DIGEST, "--steps", "1", "--resume", str(resumed), *common]) == 0
    capsys.readouterr()
    assert main(["eval", DIGEST, "--data", str(data), "--resume", str(resumed)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "No such file" not in err
    # eval says what it resumed, then loads as run does: the load line after the resume
    said = [line.split(" ", 2)[1] for line in err.splitlines() if line.startswith("[eval] ")]
    assert said[:2] == ["resumed", "loaded"], err
    assert f"[eval] resumed from {resumed} (step 2)" in err, err


def test_a_run_by_digest_verifies_its_store_entry_once(
    server: BundleServer,
    store: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    xla_cache: Path,
) -> None:
    """Before: the check of the outputs, the check that no output is an input, the load
    (and, with --resume, the look for a bundle without weights) each looked the digest up
    and hashed the whole entry again: 3-4 full reads of a bundle of many GB per run."""
    pull(f"{server.url}/b.stepbundle", expect_digest=DIGEST)
    batches = golden_batches(NAME)
    data = tmp_path / "d.npz"
    np.savez(data, **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    common = ["--data", str(data), "--json", "--cache-dir", str(xla_cache)]
    ck = tmp_path / "ck"
    caplog.set_level(logging.DEBUG, logger="stepbundle.runtime.io.store")

    def verified() -> int:
        n = sum(r.getMessage().startswith("verifying the store entry") for r in caplog.records)
        caplog.clear()
        return n

    assert main(["run", DIGEST, "--steps", "2", "--checkpoint-dir", str(ck), *common]) == 0
    assert verified() == 1
    resumed = str(sorted(ck.glob("step-*.safetensors"))[-1])
    capitals = "sha256:" + DIGEST.removeprefix("sha256:").upper()  # the same digest
    assert main(["run", capitals, "--steps", "1", "--resume", resumed, *common]) == 0
    assert verified() == 1
    other = "sha256:" + "0" * 64
    assert main(["run", DIGEST, "--steps", "1", "--expect-digest", other, *common]) == 1
    assert verified() == 1
