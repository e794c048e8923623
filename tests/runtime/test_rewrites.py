"""The rewrite pipeline (``runtime/compile/rewrites.py``) and the compile cache object.

A rewrite is one function and one line in ``REWRITES``; these tests add one the way the
docstring says, and check that it runs on every program compiled, sees the step before
``pack-state`` wraps it, and that what it changes is in the cache key (a miss, not a
wrong hit), with no cache version bump.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import CacheOutcome, CompileOptions, LoadOptions, load
from stepbundle.runtime.compile import rewrites
from stepbundle.runtime.compile.compile_cache import CompileCache
from stepbundle.runtime.compile.rewrites import REWRITES, RewriteContext, Stage
from stepbundle.stablehlo.precision import set_matmul_precision

BUNDLE = "linear_adamw"
PROGRAMS = {"train[0]", "train[1]", "eval[0]", "eval[1]"}


def test_the_pipeline_is_named_and_ordered() -> None:
    names = [name for name, _ in REWRITES]
    assert len(set(names)) == len(names)
    assert names[0] == "strip-attributes"  # nothing the module says about itself is kept
    assert names[-1] == "aliasing-and-sharding"  # annotates the final @main
    assert names.index("matmul-precision") < names.index("pack-state")
    assert names.index("canonical-convolutions") < names.index("steps-per-call")


def _with(extra: tuple[str, rewrites.Rewrite]) -> tuple[tuple[str, rewrites.Rewrite], ...]:
    """``REWRITES`` with ``extra`` where a rewrite of the step's own ops goes."""
    at = [name for name, _ in REWRITES].index("pack-state")
    return (*REWRITES[:at], extra, *REWRITES[at:])


def test_an_added_rewrite_runs_on_every_program_before_packing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str, int, bool]] = []

    def spy(stage: Stage, ctx: RewriteContext) -> Stage:
        assert ctx.layout is not None and ctx.layout.packs  # the trainer packs this state
        wrapped = "stepbundle_step" in stage.module.text()  # packing.py's callee
        seen.append((ctx.platform, len(stage.program.inputs), wrapped))
        return stage

    monkeypatch.setattr(rewrites, "REWRITES", _with(("spy", spy)))
    t = load(golden_bundle(BUNDLE))
    assert len(seen) == len(PROGRAMS)
    assert all(platform == "cpu" and not wrapped for platform, _, wrapped in seen)
    t.step(golden_batches(BUNDLE)[0])


def test_what_a_rewrite_changes_is_in_the_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    first = load(
        golden_bundle(BUNDLE),
        options=LoadOptions(compile=CompileOptions(cache_dir=cache, matmul_precision="default")),
    )
    assert {e.outcome for e in first.load_info.cache.values()} == {CacheOutcome.MISS}

    def highest(stage: Stage, ctx: RewriteContext) -> Stage:
        set_matmul_precision(stage.module, "highest")
        return stage

    monkeypatch.setattr(rewrites, "REWRITES", _with(("highest", highest)))
    changed = load(
        golden_bundle(BUNDLE),
        options=LoadOptions(compile=CompileOptions(cache_dir=cache, matmul_precision="default")),
    )
    assert {e.outcome for e in changed.load_info.cache.values()} == {CacheOutcome.MISS}
    monkeypatch.undo()
    again = load(
        golden_bundle(BUNDLE),
        options=LoadOptions(compile=CompileOptions(cache_dir=cache, matmul_precision="default")),
    )
    assert {e.outcome for e in again.load_info.cache.values()} == {CacheOutcome.HIT}
    assert again.load_info.cache_hits == len(PROGRAMS) and again.load_info.compiled == 0


def test_the_cache_records_an_event_per_program(tmp_path: Path) -> None:
    off = CompileCache(None)
    assert off.events == {} and off.hits == 0 and off.compiled == 0
    t = load(
        golden_bundle(BUNDLE),
        options=LoadOptions(compile=CompileOptions(cache_dir=tmp_path / "c", steps_per_call=2)),
    )
    assert set(t.load_info.cache) == PROGRAMS | {"train[0]x2", "train[1]x2"}
    assert t.load_info.compiled == 6 and t.load_info.cache_hits == 0
    assert all(e.path is not None and Path(e.path).is_file() for e in t.load_info.cache.values())
