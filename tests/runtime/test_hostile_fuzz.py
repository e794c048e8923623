"""Fuzzing the reader and the loader with damaged golden bundles (bounded, deterministic).

Every mutation family of tests/hostile_fuzz.py runs for a fixed number of derandomized
hypothesis cases: byte flips, truncations, appended and inserted bytes, header fields,
manifest fields edited past the digest (wrong types, huge numbers, negative offsets, huge
shapes, duplicated names, missing keys), coherent manifest edits that reach the runtime's
own checks, and tensor data rewritten with a matching digest. Each damaged file is opened,
every section read, verified, and, if it opened, loaded and stepped. Every outcome must be
a clean load or a BundleError, within a time limit, with the reader's allocations bounded.
The long run of the same cases is ``python scripts/fuzz.py``.
"""

from __future__ import annotations

import copy
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hostile_fuzz import (
    MUTATIONS,
    READER_ALLOCATION_LIMIT,
    CaseTimeout,
    Golden,
    HypothesisDraw,
    RandomDraw,
    assemble_file,
    exercise,
    load_golden,
    mutate,
    pack_wire,
    time_limit,
)
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from runtime_helpers import GOLDEN_NAMES, golden_batches

from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.schema import SchemaValidationError

CASES_PER_MUTATION = 40
CASE_SECONDS = 60.0  # far above any real case (a fresh compile takes about 0.5 s)

_GOLDENS: dict[str, Golden] = {}
_BATCHES: dict[str, dict[str, Any]] = {}


def _goldens() -> list[Golden]:
    if not _GOLDENS:
        for name in GOLDEN_NAMES:
            _GOLDENS[name] = load_golden(name)
            _BATCHES[name] = golden_batches(name)[0]
    return [_GOLDENS[n] for n in GOLDEN_NAMES]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@settings(
    max_examples=CASES_PER_MUTATION,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_damaged_bundles_load_cleanly_or_raise_bundle_errors(
    mutation: str, workdir: Path, data: st.DataObject
) -> None:
    draw = HypothesisDraw(data)
    goldens = _goldens()
    golden = goldens[draw.integer(0, len(goldens) - 1)]
    damaged, what = MUTATIONS[mutation](draw, golden)
    stop = bool(draw.integer(0, 1))
    note(f"{golden.name}, {mutation}: {what}; stop_on_nonfinite={stop}")
    path = workdir / "case.stepbundle"
    path.write_bytes(damaged)
    with time_limit(CASE_SECONDS):
        outcome = exercise(
            path,
            cache_dir=workdir / "xla-cache",
            batch=_BATCHES[golden.name],
            stop_on_nonfinite=stop,
        )
    note(f"outcome: {outcome}")
    assert outcome.reader_peak < READER_ALLOCATION_LIMIT


def test_mutate_draws_every_family_from_one_entry_point() -> None:
    seen = {mutate(RandomDraw(random.Random(i)), _goldens()).mutation for i in range(300)}
    assert seen == set(MUTATIONS)


def test_the_time_limit_interrupts_a_hang() -> None:
    start = time.monotonic()
    with pytest.raises(CaseTimeout), time_limit(0.2):
        while True:
            pass
    assert time.monotonic() - start < 5


def test_a_huge_batch_spec_is_refused_at_load_without_allocating(tmp_path: Path) -> None:
    # 2**62 bytes of batch input pass the format's limits (below 2**63), so the schema
    # accepts them; the runtime must refuse them from the program's signature, before
    # anything is allocated for them.
    golden = load_golden("linear_adamw")
    wire = copy.deepcopy(golden.wire)
    program = wire["entries"]["train"]["programs"][0]
    huge = [2**31, 2**29]  # f32: 2**62 bytes
    for b in program["batch"]:
        if b["name"] == "x":
            b["spec"]["shape"] = huge
    for i in program["inputs"]:
        if i["kind"] == "batch" and i["name"] == "x":
            i["spec"]["shape"] = huge
    path = tmp_path / "huge.stepbundle"
    path.write_bytes(assemble_file(pack_wire(wire), golden.data_area))
    tracemalloc.start()
    try:
        with pytest.raises(SchemaValidationError) as info:
            load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.path.startswith("entries.train.programs[0].inputs[")
    assert "f32[2147483648,536870912]" in str(info.value)
    assert peak < READER_ALLOCATION_LIMIT
