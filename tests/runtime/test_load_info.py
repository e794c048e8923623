"""No silent fallbacks: ``load_info`` says which path the runtime took, and why.

The runtime has a fast path and a fallback for host-to-device transfers and for
dispatching a step, and the compile cache falls back to compiling. Each choice is in
the trainer's ``load_info`` with its reason, and each fallback warns once per process
(``StepbundleFallbackWarning``; ``CacheWarning`` is one). The steps' numbers are the
same on either path.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import CompileOptions, LoadOptions, _compat, fallback, load
from stepbundle.runtime.compile import compile_cache
from stepbundle.runtime.compile.compile_cache import CacheOutcome, CacheWarning
from stepbundle.runtime.fallback import PathKind, StepbundleFallbackWarning

BUNDLE = "linear_adamw"
PROGRAMS = {"train[0]", "train[1]", "eval[0]", "eval[1]"}


def first_loss(trainer: Any) -> float:
    return float(trainer.step(golden_batches(BUNDLE)[0])["loss"])


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which fallbacks this process has already warned about."""
    monkeypatch.setattr(fallback, "_WARNED", set())


def fallbacks(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, StepbundleFallbackWarning)]


def test_the_fast_paths_are_reported() -> None:
    t = load(golden_bundle(BUNDLE), options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    info = t.load_info
    assert info.transfer is not None
    assert info.transfer.operation == "transfer"
    assert info.transfer.kind is PathKind.FAST, info.transfer.reason
    assert set(info.dispatch) == PROGRAMS
    assert all(p.kind is PathKind.FAST for p in info.dispatch.values())
    assert {e.outcome for e in info.cache.values()} == {CacheOutcome.OFF}
    assert {e.reason for e in info.cache.values()} == {"cache off"}


def test_a_failed_transfer_probe_falls_back_visibly(
    monkeypatch: pytest.MonkeyPatch, fresh_warnings: None
) -> None:
    want = first_loss(load(golden_bundle(BUNDLE)))
    # As if jaxlib's internal transfer had gone: probed again, it is missing.
    monkeypatch.setattr(_compat, "_FAST_PUT", [])
    monkeypatch.setattr(_compat, "_TRANSFER", [])
    monkeypatch.setattr(_compat, "_make_fast_put", lambda: (None, "probe says no"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = load(golden_bundle(BUNDLE))
        second = load(golden_bundle(BUNDLE))
    for t in (first, second):
        transfer = t.load_info.transfer
        assert transfer is not None and transfer.kind is PathKind.FALLBACK
        assert transfer.reason == "probe says no"
    (warned,) = fallbacks(caught)  # once per process, not once per load
    assert "jax.device_put" in str(warned.message) and "probe says no" in str(warned.message)
    assert first_loss(second) == want


def test_missing_result_handlers_fall_back_visibly(
    monkeypatch: pytest.MonkeyPatch, fresh_warnings: None
) -> None:
    want = first_loss(load(golden_bundle(BUNDLE)))
    monkeypatch.delattr(_compat.xla_client, "array_result_handler")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = load(golden_bundle(BUNDLE))
    assert set(t.load_info.dispatch) == PROGRAMS
    for path in t.load_info.dispatch.values():
        assert path.kind is PathKind.FALLBACK
        assert "AttributeError" in path.reason
    (warned,) = fallbacks(caught)  # four programs, one warning
    assert "LoadedExecutable.execute" in str(warned.message)
    assert first_loss(t) == want


def test_a_damaged_cache_entry_is_a_miss_with_its_reason(
    tmp_path: Path, fresh_warnings: None
) -> None:
    cache = tmp_path / "cache"
    load(golden_bundle(BUNDLE), options=LoadOptions(compile=CompileOptions(cache_dir=cache)))
    for entry in cache.glob("*.xla"):
        data = bytearray(entry.read_bytes())
        data[-1] ^= 0x40  # one bit of the payload
        entry.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = load(
            golden_bundle(BUNDLE), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
        )
    assert set(t.load_info.cache) == PROGRAMS
    for event in t.load_info.cache.values():
        assert event.outcome is CacheOutcome.MISS
        assert event.reason == "the entry is damaged (its digest does not match)"
        assert event.write_error is None  # replaced by a good entry
    (warned,) = fallbacks(caught)
    assert warned.category is CacheWarning
    assert "was not used: the entry is damaged" in str(warned.message)
    healed = load(
        golden_bundle(BUNDLE), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    assert {e.outcome for e in healed.load_info.cache.values()} == {CacheOutcome.HIT}


def test_a_read_only_cache_is_reported_and_warned_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_warnings: None
) -> None:
    # A read-only file system (chmod would not stop root, who runs some CI).
    def read_only(path: Any, content: Any, **_: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(compile_cache, "atomic_write", read_only)
    cache = tmp_path / "cache"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = load(
            golden_bundle(BUNDLE), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
        )
        second = load(
            golden_bundle(BUNDLE), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
        )
    for t in (first, second):
        for event in t.load_info.cache.values():
            assert event.outcome is CacheOutcome.MISS
            assert event.reason == "no entry"
            assert event.write_error is not None and "Read-only file system" in event.write_error
        assert t.load_info.compiled == len(PROGRAMS) and t.load_info.cache_hits == 0
    (warned,) = fallbacks(caught)  # eight failed writes, one warning
    assert warned.category is CacheWarning
    assert "cannot write the compile cache" in str(warned.message)
    assert first_loss(second) == first_loss(load(golden_bundle(BUNDLE)))
