"""Every option record refuses a bad field when it is built, with UsageError (the
caller's mistake, one root to catch) naming the field: issue #43, item 10. Before, ``init_from=5``
failed later with a raw TypeError, and ``steps_per_call=2**40``, ``cache_dir="memory://x"``,
``entries=()``, a non-bool flag and an ``expect_digest`` that is not a string were accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepbundle.runtime import (
    CompileOptions,
    LoadOptions,
    ParallelOptions,
    SafetyOptions,
    StateOptions,
)
from stepbundle.runtime.errors import UsageError

BAD: list[tuple[Any, dict[str, Any], str]] = [
    (StateOptions, {"init_from": 5}, "init_from must be a path"),
    (StateOptions, {"init_from": ""}, "init_from must be a path"),
    (StateOptions, {"init_strict": "no"}, "init_strict must be True or False"),
    (StateOptions, {"pack_state": -1}, "pack_state must be"),
    (CompileOptions, {"steps_per_call": 2**40}, "is more than 1048576"),
    (CompileOptions, {"steps_per_call": 0}, "at least 1"),
    (CompileOptions, {"cache_dir": "memory://x"}, "lives only in this process"),
    (CompileOptions, {"cache_dir": 3}, "cache_dir must be a path"),
    (CompileOptions, {"entries": ()}, "at least one entry"),
    (CompileOptions, {"entries": ("train", "")}, "no empty name"),
    (CompileOptions, {"keep_freed_memory": "yes"}, "keep_freed_memory must be"),
    (CompileOptions, {"compile_only": 1}, "compile_only must be True or False"),
    (CompileOptions, {"fused_attention": "off"}, "fused_attention must be True or False"),
    (CompileOptions, {"regather_weights": "on"}, 'regather_weights must be True, False or "auto"'),
    (CompileOptions, {"device_memory": 0}, "device_memory must be a number of bytes"),
    (CompileOptions, {"device_memory": 1.5e10}, "device_memory must be a number of bytes"),
    (SafetyOptions, {"stop_on_nonfinite": "yes"}, "stop_on_nonfinite must be True or False"),
    (SafetyOptions, {"expect_digest": 1234}, "expect_digest must be a bundle digest"),
    (ParallelOptions, {"shard_optimizer_state": 1}, "must be True or False"),
]


@pytest.mark.parametrize(("record", "fields", "words"), BAD, ids=[str(f) for _, f, _ in BAD])
def test_a_bad_field_is_refused_where_the_record_is_built(
    record: Any, fields: dict[str, Any], words: str
) -> None:
    with pytest.raises(UsageError) as info:
        record(**fields)
    assert words in str(info.value)


def test_the_flat_keywords_are_checked_the_same_way() -> None:
    with pytest.raises(UsageError, match="init_from must be a path"):
        LoadOptions.from_keywords(init_from=5)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="at least one entry"):
        LoadOptions.from_keywords(entry=[])


def test_good_values_are_kept(tmp_path: Path) -> None:
    digest = "sha256:" + "ab" * 32
    assert StateOptions(init_from=tmp_path, pack_state=2).pack_state == 2
    assert CompileOptions(entries="eval", cache_dir=tmp_path, steps_per_call=32).entries == (
        "eval",
    )
    assert CompileOptions(cache_dir=False).cache_dir is False
    assert SafetyOptions(expect_digest=digest).expect_digest == digest
    assert SafetyOptions(expect_digest="AB" * 32).expect_digest == "AB" * 32
