"""``compile_offline``: a bundle compiled for a device list without loading it (#41 item 5:
TPU slices are planned from compile-only devices; here, virtual CPU devices).

It must compile exactly what ``load`` compiles for the same devices and layout (the same
partitioned program), place nothing, and refuse what ``load`` refuses.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from stepbundle.runtime import CompileOptions, LoadOptions, ParallelOptions, UsageError, load
from stepbundle.runtime.compile.regather_choice import memory_need
from stepbundle.runtime.offline import compile_offline

GPT = Path(__file__).resolve().parent / "data" / "tiny_gpt.stepbundle"


def _hlo(exe: object) -> str:
    return "\n".join(m.to_string() for m in exe.hlo_modules())  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def four() -> list[object]:
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.fail("tests/conftest.py gives the runtime tests 4 virtual CPU devices")
    return devices[:4]


def test_fsdp_compiles_the_program_load_compiles(four: list[object]) -> None:
    options = LoadOptions.from_keywords(cache_dir=False, devices=4, layout="fsdp")
    out = compile_offline(GPT, four, LoadOptions(parallel=ParallelOptions(layout="fsdp")))
    assert out.placement.layout == "fsdp" and out.placement.mesh_axes == [("data", 4)]
    assert set(out.executables) == {"train[0]"} and out.refused == {}
    assert out.fused_attention == {"train[0]": 0}  # the fusion is a TPU rewrite
    exe = out.executables["train[0]"]
    trainer = load(GPT, options=options)
    batch = {"idx": np.zeros((8, 8), np.int64), "y": np.zeros((8, 8), np.int64)}
    plan, _ = trainer._dispatcher.pick("train", batch)
    loaded = plan.executable
    assert _hlo(exe) == _hlo(loaded)
    assert "all-gather" in _hlo(exe)  # the split parameters are gathered
    ours, theirs = exe.get_compiled_memory_stats(), loaded.get_compiled_memory_stats()
    assert ours.argument_size_in_bytes == theirs.argument_size_in_bytes
    assert ours.temp_size_in_bytes == theirs.temp_size_in_bytes


def test_a_bucket_that_does_not_split_is_refused_not_compiled() -> None:
    three = jax.devices("cpu")[:3]  # the GPT's batch of 8 rows does not split over 3
    out = compile_offline(GPT, three)
    assert out.executables == {}
    assert "do not split evenly" in out.refused["train[0]"]


def test_a_device_count_the_options_contradict_is_refused(four: list[object]) -> None:
    with pytest.raises(UsageError, match="given 4 device"):
        compile_offline(GPT, four, LoadOptions(parallel=ParallelOptions(devices=2)))


def test_regather_weights_auto_weighs_the_plan_against_the_device_memory(
    four: list[object],
) -> None:
    """#41: ``compile_offline`` under ``regather_weights="auto"`` compiles the program as
    written; with ``device_memory`` below XLA's plan of it, the program with the weights
    re-gathered too, and says so (on a described TPU slice, libtpu's refusal does this)."""

    def options(**compile: object) -> LoadOptions:
        return LoadOptions(
            compile=CompileOptions(**compile),  # type: ignore[arg-type]
            parallel=ParallelOptions(layout="fsdp"),
        )

    plain = compile_offline(GPT, four, options())
    assert plain.regathered_products == {}
    need = memory_need(plain.executables["train[0]"])
    assert need is not None
    tight = compile_offline(GPT, four, options(device_memory=need - 1))
    assert tight.regathered_products["train[0]"] >= 9
    words = tight.regather_choice["train[0]"]
    assert f"needs {need:,} bytes a device, over the {need - 1:,}" in words, words
    forced = compile_offline(GPT, four, options(regather_weights=True))
    assert _hlo(tight.executables["train[0]"]) == _hlo(forced.executables["train[0]"])
