"""``load(path, device, options=LoadOptions(...))``: options checked where they are made.

Every option record refuses a bad value in ``__post_init__`` with the typed error ``load``
raised for it, before any file is opened; ``LoadOptions.from_keywords`` builds the same
records from flat names, and ``load`` takes nothing but a ``LoadOptions``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import golden_bundle

import stepbundle.runtime as sr
from stepbundle.runtime import (
    CompileOptions,
    LoadOptions,
    ParallelOptions,
    SafetyOptions,
    StateOptions,
    UsageError,
    load,
)

BUNDLE = "linear_adamw"


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: CompileOptions(steps_per_call=0), UsageError, "steps_per_call must be"),
        (lambda: CompileOptions(steps_per_call=True), UsageError, "steps_per_call must be"),
        (lambda: CompileOptions(matmul_precision="fast"), UsageError, "one of default"),
        (lambda: CompileOptions(entries=[1]), UsageError, "entries must be"),
        (lambda: StateOptions(pack_state=-1), UsageError, "pack_state must be"),
        (lambda: StateOptions(pack_state=2.5), UsageError, "pack_state must be"),
        (lambda: SafetyOptions(check_state=True), UsageError, "needs stop_on_nonfinite"),
        (lambda: ParallelOptions(devices="most"), UsageError, "a number or 'all'"),
        (lambda: ParallelOptions(devices=0), UsageError, "at least 1"),
        (lambda: ParallelOptions(devices=1.5), UsageError, "whole number"),
        (
            lambda: LoadOptions(
                compile=CompileOptions(compile_only=True), state=StateOptions(init_from="x")
            ),
            UsageError,
            "compile_only places no state",
        ),
    ],
)
def test_a_bad_option_is_refused_where_it_is_made(make: Any, error: type, words: str) -> None:
    with pytest.raises(error, match=words) as err:
        make()
    message = str(err.value)
    assert message[:1].isalpha() and message.endswith("."), message  # whole sentences


def test_options_are_frozen_and_normalized() -> None:
    c = CompileOptions(entries="eval")
    assert c.entries == ("eval",)
    assert CompileOptions(entries=["train", "eval"]).entries == ("train", "eval")
    with pytest.raises(AttributeError):
        c.steps_per_call = 2  # type: ignore[misc]


def test_a_bad_option_is_refused_before_the_bundle_is_opened(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.stepbundle"
    with pytest.raises(UsageError, match="steps_per_call must be"):
        load(
            missing, options=LoadOptions(compile=CompileOptions(cache_dir=False, steps_per_call=0))
        )


def test_keywords_build_the_same_options() -> None:
    kw = LoadOptions.from_keywords(
        entry="eval",
        cache_dir=False,
        stop_on_nonfinite=True,
        check_state=True,
        pack_state=0,
        steps_per_call=2,
        matmul_precision="high",
        devices=1,
    )
    assert kw == LoadOptions(
        compile=CompileOptions(
            entries=("eval",), cache_dir=False, steps_per_call=2, matmul_precision="high"
        ),
        state=StateOptions(pack_state=0),
        safety=SafetyOptions(stop_on_nonfinite=True, check_state=True),
    )


def test_load_takes_options_only() -> None:
    """The keyword arguments ``load`` took before ``LoadOptions`` are gone, and a flat
    dict in place of the options is refused in words that name the fix."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache_dir'"):
        load(golden_bundle(BUNDLE), cache_dir=False)  # type: ignore[call-arg]
    with pytest.raises(UsageError, match="LoadOptions.from_keywords"):
        load(golden_bundle(BUNDLE), "cpu", {"cache_dir": False})  # type: ignore[arg-type]


def test_the_names_the_readme_uses_are_exported() -> None:
    """What the README and docs/ reach for is at ``stepbundle.runtime``, not in a submodule."""
    root = Path(__file__).resolve().parents[2]
    text = "\n".join(
        p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    )
    for name in ("to_floats", "write_dataset", "set_cpu_devices", "ALLOWED_CUSTOM_CALLS"):
        assert f"stepbundle.runtime.{name}" in text or f"sr.{name}" in text, name
        assert name in sr.__all__ and hasattr(sr, name), name
    # A public name is never spelled through its submodule.
    deep = re.findall(r"stepbundle\.runtime\.[a-z_]+\.([A-Za-z_]+)", text)
    assert not [n for n in deep if n in sr.__all__], deep
    assert all(hasattr(sr, name) for name in sr.__all__)
