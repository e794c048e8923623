"""A compile cache shared between processes and hosts: a folder, or a URL.

Two processes: ``stepbundle compile`` fills a folder (named by a ``file://`` URL), and a
second process that loads the bundle from the plain path compiles nothing. A cache at a
URL (a local folder behind a non-local fsspec file system) keeps the local cache's
guarantees: every entry is checked before use, a damaged or foreign entry is a miss
(recompiled, the reason in ``load_info``), and an upload that breaks off leaves no
entry under its final name. The oracle for results is the same bundle with no cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from remote_helpers import FakeObjectStore, fake_store
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import (
    CacheOutcome,
    CacheWarning,
    CompileOptions,
    LoadOptions,
    fallback,
    load,
)

NAME = "linear_adamw"
BUNDLE = str(golden_bundle(NAME))

_CHILD = """
import json, sys
from stepbundle.runtime import LoadOptions, load
t = load(sys.argv[1], options=LoadOptions.from_keywords(cache_dir=sys.argv[2], entry="train"))
print(json.dumps({"compiled": t.load_info.compiled, "hits": t.load_info.cache_hits,
                  "events": {k: [e.outcome.value, e.reason] for k, e in t.load_info.cache.items()}}))
"""


def _losses(trainer: object) -> list[float]:
    return [float(m["loss"]) for m in trainer.run(golden_batches(NAME), 3)]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def want() -> list[float]:
    return _losses(load(BUNDLE, options=LoadOptions(compile=CompileOptions(entries="train"))))


def test_a_second_process_compiles_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "shared"
    env = {**os.environ, "STEPBUNDLE_CACHE_DIR": str(tmp_path / "private")}
    first = subprocess.run(
        [sys.executable, "-m", "stepbundle", "compile", BUNDLE, "--entry", "train"]
        + ["--cache-dir", cache.as_uri()],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("compiled and written") == 2, first.stdout  # 2 shape buckets
    assert len(list(cache.glob("*.xla"))) == 2
    second = subprocess.run(
        [sys.executable, "-c", _CHILD, BUNDLE, str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert second.returncode == 0, second.stderr
    info = json.loads(second.stdout.splitlines()[-1])
    assert (info["compiled"], info["hits"]) == (0, 2)
    assert {tuple(e) for e in info["events"].values()} == {("hit", "verified entry")}


@pytest.fixture
def store_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Warnings are once per process: these tests start afresh and leave no trace.
    monkeypatch.setattr(fallback, "_WARNED", set())
    yield from fake_store(tmp_path / "objects")


def test_a_cache_at_a_url_is_checked_like_a_folder(store_root: Path, want: list[float]) -> None:
    url = "fakestore://team/xla-cache"
    cold = load(BUNDLE, options=LoadOptions(compile=CompileOptions(cache_dir=url, entries="train")))
    assert {(e.outcome, e.reason) for e in cold.load_info.cache.values()} == {
        (CacheOutcome.MISS, "no entry")
    }
    objects = sorted((store_root / "team" / "xla-cache").iterdir())
    assert [p.suffix for p in objects] == [".xla", ".xla"]  # no temporary object left
    assert {str(e.path) for e in cold.load_info.cache.values()} == {
        f"{url}/{p.name}" for p in objects
    }
    warm = load(BUNDLE, options=LoadOptions(compile=CompileOptions(cache_dir=url, entries="train")))
    assert (warm.load_info.compiled, warm.load_info.cache_hits) == (0, 2)
    assert _losses(warm) == want

    # One bit of one payload: that program is compiled again, with the reason; the
    # other is still a hit; the damaged entry is replaced.
    damaged = bytearray(objects[0].read_bytes())
    damaged[-1] ^= 0x40
    objects[0].write_bytes(bytes(damaged))
    with pytest.warns(CacheWarning, match=f"entry in {url} was not used: the entry is damaged"):
        healed = load(
            BUNDLE, options=LoadOptions(compile=CompileOptions(cache_dir=url, entries="train"))
        )
    reasons = sorted(e.reason for e in healed.load_info.cache.values())
    assert reasons == ["the entry is damaged (its digest does not match)", "verified entry"]
    assert healed.load_info.compiled == 1 and _losses(healed) == want
    # Another program's entry copied under this one's name is a miss too, never run.
    objects[1].write_bytes(objects[0].read_bytes())
    with pytest.warns(CacheWarning, match="another program"):
        fallback._WARNED.clear()
        foreign = load(
            BUNDLE, options=LoadOptions(compile=CompileOptions(cache_dir=url, entries="train"))
        )
    assert "the entry belongs to another program or device set" in {
        e.reason for e in foreign.load_info.cache.values()
    }
    assert foreign.load_info.compiled == 1 and _losses(foreign) == want


def test_an_upload_that_breaks_off_leaves_no_entry(store_root: Path, want: list[float]) -> None:
    FakeObjectStore.fail_writes_after = 1000  # every entry is larger
    with pytest.warns(CacheWarning, match="cannot write the compile cache in fakestore://"):
        t = load(
            BUNDLE,
            options=LoadOptions(
                compile=CompileOptions(cache_dir="fakestore://team/xla-cache", entries="train")
            ),
        )
    for event in t.load_info.cache.values():
        assert event.outcome is CacheOutcome.MISS
        assert event.write_error is not None and "dropped the upload" in event.write_error
    folder = store_root / "team" / "xla-cache"
    assert not folder.exists() or list(folder.iterdir()) == []  # neither entry nor temp
    assert _losses(t) == want
