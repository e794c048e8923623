"""The compile cache never runs a wrong executable and never crashes on a bad entry.

Every entry carries its own key and the SHA-256 of its payload, checked before XLA sees
a byte of it. A damaged entry, another program's entry renamed into place, a truncated
or empty file, a directory where the file should be: each is a miss whose reason the
load info reports, the program is compiled again, and the step's numbers equal an
uncached load's. An entry that cannot be written warns once and the run goes on.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.runtime.compile.compile_cache import CacheOutcome, CacheWarning


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.xla"))


def first_loss(trainer: object, name: str) -> float:
    return float(trainer.step(golden_batches(name)[0])["loss"])  # type: ignore[attr-defined]


def test_hits_are_verified_and_reported(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cold = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    assert {e.outcome for e in cold.load_info.cache.values()} == {CacheOutcome.MISS}
    assert {e.reason for e in cold.load_info.cache.values()} == {"no entry"}
    warm = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    assert {e.outcome for e in warm.load_info.cache.values()} == {CacheOutcome.HIT}
    assert set(warm.load_info.cache) == {"train[0]", "train[1]", "eval[0]", "eval[1]"}
    off = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=False))
    )
    assert {e.outcome for e in off.load_info.cache.values()} == {CacheOutcome.OFF}


@pytest.mark.filterwarnings("ignore::stepbundle.runtime.CacheWarning")
def test_a_foreign_entry_renamed_into_place_is_a_miss(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    other_cache = tmp_path / "other"
    load(
        golden_bundle("dropout_sgd"),
        options=LoadOptions(compile=CompileOptions(cache_dir=other_cache)),
    )
    (foreign,) = entries(other_cache)[:1]
    for target in entries(cache):  # every linear_adamw entry is now dropout_sgd's program
        shutil.copyfile(foreign, target)
    again = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    assert again.load_info.cache_hits == 0
    reasons = {e.reason for e in again.load_info.cache.values()}
    assert reasons == {"the entry belongs to another program or device set"}
    want = first_loss(
        load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(compile=CompileOptions(cache_dir=False)),
        ),
        "linear_adamw",
    )
    assert first_loss(again, "linear_adamw") == want


def _damage(data: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:  # one flipped bit anywhere
        i = rng.randrange(len(data))
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1 :]
    if kind == 1:  # truncated
        return data[: rng.randrange(len(data))]
    if kind == 2:  # bytes appended
        return data + rng.randbytes(rng.randrange(1, 64))
    if kind == 3:  # a run of random bytes overwritten
        i = rng.randrange(len(data))
        n = rng.randrange(1, 128)
        return data[:i] + rng.randbytes(n) + data[i + n :]
    return b""  # empty


FUZZ_CHILD = r"""
import random, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import pytest
from runtime_helpers import golden_batches, golden_bundle
from test_cache_integrity import _damage
from stepbundle.runtime import LoadOptions, load

cache, rounds = Path(sys.argv[1]), int(sys.argv[2])
batch = golden_batches("linear_adamw")[0]
want = float(load(golden_bundle("linear_adamw"), options=LoadOptions.from_keywords(cache_dir=False, entry="train")).step(batch)["loss"])
load(golden_bundle("linear_adamw"), options=LoadOptions.from_keywords(cache_dir=cache, entry="train"))
pristine = {p: p.read_bytes() for p in cache.glob("*.xla")}
rng = random.Random(20261201)
wrong = hits = 0
for r in range(rounds):
    for p, data in pristine.items():
        damaged = _damage(data, rng)
        p.write_bytes(damaged)
    t = load(golden_bundle("linear_adamw"), options=LoadOptions.from_keywords(cache_dir=cache, entry="train"))
    hits += t.load_info.cache_hits
    wrong += float(t.step(batch)["loss"]) != want
print(f"rounds={rounds} entries={rounds * len(pristine)} wrong={wrong} hits={hits}")
"""


def test_fuzzed_entries_are_misses_never_wrong_never_a_crash(tmp_path: Path) -> None:
    # In a child process: a damaged executable reaching XLA could kill the process,
    # which must show as a failure here, not take pytest down with it.
    tests_runtime = str(Path(__file__).resolve().parent)
    script = tmp_path / "fuzz_child.py"
    script.write_text(FUZZ_CHILD)
    rounds = int(os.environ.get("STEPBUNDLE_CACHE_FUZZ_ROUNDS", "150"))
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cache"), str(rounds), tests_runtime],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(f"rounds={rounds} entries=")
    fields = dict(kv.split("=") for kv in line.split())
    assert fields["wrong"] == "0"
    # A damage that happens to leave the entry intact (appending to nothing, say) could
    # still hit; the check above is what matters. Most rounds must have been misses.
    assert int(fields["hits"]) < int(fields["entries"]) // 10


def test_a_directory_in_place_of_an_entry_is_a_miss_and_a_write_error(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(compile=CompileOptions(cache_dir=cache, entries="eval")),
    )
    for p in entries(cache):
        p.unlink()
        p.mkdir()  # the entry's name is taken by a folder: unreadable and unwritable
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(compile=CompileOptions(cache_dir=cache, entries="eval")),
        )
    events = list(t.load_info.cache.values())
    assert all(e.outcome is CacheOutcome.MISS for e in events)
    assert all(e.reason.startswith("the entry is unreadable") for e in events)
    assert all(e.write_error for e in events)
    assert any(w.category is CacheWarning for w in caught)


def test_a_client_that_cannot_serialize_warns_once_and_the_load_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A PJRT plugin without executable serialization raises UNIMPLEMENTED from
    # serialize_executable; with the cache on by default that must not fail a load.
    from stepbundle.runtime import _compat, fallback

    def unimplemented(client: object, exe: object) -> bytes:
        raise _compat.JaxRuntimeError("UNIMPLEMENTED: executable serialization is not supported")

    monkeypatch.setattr(_compat, "serialize_executable", unimplemented)
    monkeypatch.setattr(fallback, "_WARNED", set())
    cache = tmp_path / "cache"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(compile=CompileOptions(cache_dir=cache)),
        )
    events = list(t.load_info.cache.values())
    assert len(events) == 4
    assert all(e.outcome is CacheOutcome.MISS for e in events)
    errors = [e.write_error or "" for e in events]
    # jax 0.7's class is XlaRuntimeError (jax.errors.JaxRuntimeError names it).
    assert all(w.startswith(("JaxRuntimeError: ", "XlaRuntimeError: ")) for w in errors)
    assert all("UNIMPLEMENTED" in w for w in errors)
    said = [w for w in caught if w.category is CacheWarning]
    assert len(said) == 1  # once, not once per program
    assert "cannot write the compile cache" in str(said[0].message)
    assert entries(cache) == []
    want = first_loss(
        load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(compile=CompileOptions(cache_dir=False)),
        ),
        "linear_adamw",
    )
    assert first_loss(t, "linear_adamw") == want


KEY_CHILD = r"""
import sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[2])
from runtime_helpers import golden_bundle
from stepbundle.runtime import LoadOptions, load
for _ in range(int(sys.argv[3])):  # each load reads the cache folder afresh
    t = load(golden_bundle("linear_adamw"), options=LoadOptions.from_keywords(cache_dir=sys.argv[1], entry="eval"))
    print(" ".join(sorted(e.outcome.value for e in t.load_info.cache.values())))
"""


def test_other_xla_flags_are_a_miss(tmp_path: Path) -> None:
    # XLA reads its flags once per process, so each load runs in a child of its own.
    tests_runtime = str(Path(__file__).resolve().parent)
    cache = str(tmp_path / "cache")

    def outcomes(loads: int = 1, **env: str) -> list[str]:
        """What the cache did for each of ``loads`` loads in one child under ``env``."""
        child = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
        out = subprocess.run(
            [sys.executable, "-c", KEY_CHILD, cache, tests_runtime, str(loads)],
            env={**child, **env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()

    # A second load under the same flags runs in the same child: a process of its own
    # would read the same folder under the same key.
    assert outcomes(2) == ["miss miss", "hit hit"]
    fast = "--xla_cpu_enable_fast_math=true"
    assert outcomes(2, XLA_FLAGS=fast) == ["miss miss", "hit hit"]
    assert outcomes(XLA_FLAGS="--xla_cpu_enable_fast_math=false") == ["miss miss"]
    assert outcomes(LIBTPU_INIT_ARGS="--xla_tpu_some_flag=1") == ["miss miss"]
    # In a fresh process: the first entries are still there, under their keys.
    assert outcomes() == ["hit hit"]
    assert len(entries(Path(cache))) == 8
