"""Reading a TPU-compiled program for the output head's choice (runtime/compile/head_choice.py):
the fixture is libtpu's optimized HLO text, trimmed (GPT-2 small's train program through the
torch_xla front-end, whose head product fusion.275 writes 17 results, 12 of them the residual
stream; beside it the torch front-end's counterpart, which writes 5, and a fused-attention
kernel call whose configuration spans lines of its own)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stepbundle.runtime import CompileOptions
from stepbundle.runtime.compile.head_choice import estimated_cycles, fused_stream
from stepbundle.runtime.compile.program import _choose_head_barriers
from stepbundle.runtime.errors import UsageError
from stepbundle.runtime.fallback import StepbundleFallbackWarning

TEXT = (Path(__file__).parent / "data" / "head_fusion.hlo.txt").read_text()


def test_the_residual_stream_fused_into_the_head_is_found() -> None:
    found = fused_stream(TEXT)
    assert found is not None
    assert (found.fusion, found.results, found.same_shape) == ("fusion.275", 17, 12)
    assert found.shape == "f32[8,1024,768]"
    assert "17 results, 12 of them f32[8,1024,768]" in found.describe()
    assert fused_stream(TEXT, least=13) is None  # 12 of one shape, not 13


def test_only_a_product_fusion_counts() -> None:
    # the same fusion, its called computation without the product: not a head's
    no_product = re.sub(r"\n  %convolution\.148\.clone\.1 = [^\n]*", "", TEXT)
    assert no_product != TEXT
    assert fused_stream(no_product) is None
    # the torch front-end's counterpart writes 5 results, 2 of a shape: found at 2, not 4
    without = "\n".join(ln for ln in TEXT.splitlines() if "%fusion.275 =" not in ln)
    assert fused_stream(without) is None
    found = fused_stream(without, least=2)
    assert found is not None and found.fusion == "multiply_reduce_fusion.13"


def test_the_estimate_is_the_entry_computations_sum() -> None:
    # the oracle reads each entry operation's backend_config as JSON
    entry = TEXT[TEXT.index("ENTRY") :]
    total = 0
    for line in entry.splitlines():
        m = re.search(r"backend_config=(\{.*\})\s*$", line)
        if m:
            total += int(json.loads(m.group(1)).get("window_config", {}).get("estimated_cycles", 0))
    assert total > 0
    assert estimated_cycles(TEXT) == total
    # the fused computations' own lines are not the program's operations
    assert estimated_cycles(TEXT.replace("ENTRY %main.367", "%not_the_entry")) is None


def test_a_program_without_estimates_has_none() -> None:
    cpu = "HloModule m\n\nENTRY %main (a: f32[4]) -> f32[4] {\n  ROOT %a = f32[4] parameter(0)\n}\n"
    assert estimated_cycles(cpu) is None
    assert fused_stream(cpu) is None


def test_head_barriers_takes_true_false_or_auto() -> None:
    assert CompileOptions().head_barriers == "auto"
    for ok in (True, False, "auto"):
        assert CompileOptions(head_barriers=ok).head_barriers == ok
    with pytest.raises(UsageError, match='head_barriers must be True, False or "auto"'):
        CompileOptions(head_barriers="yes")  # type: ignore[arg-type]


def test_asked_for_barriers_a_program_without_a_head_says_so() -> None:
    from runtime_helpers import golden_bundle

    from stepbundle.runtime import LoadOptions, load

    trainer = load(
        golden_bundle("linear_adamw"),
        "cpu",
        LoadOptions(compile=CompileOptions(cache_dir=False, head_barriers=True)),
    )
    notes = trainer.load_info.head_barriers
    compiled = {f"{name}[{i}]" for name, e in trainer.manifest.entries.items()
                for i in range(len(e.programs))}  # fmt: skip
    assert set(notes) == compiled and "train[0]" in notes
    for label, note in notes.items():
        assert note.startswith(f"{label}: no output head to hold (no product with a dimension")
        assert "16,384" in note
    auto = load(
        golden_bundle("linear_adamw"), "cpu", LoadOptions(compile=CompileOptions(cache_dir=False))
    )
    assert auto.load_info.head_barriers == {}  # "auto" weighs nothing off a TPU


# The load's choice (program.py's _choose_head_barriers) over executables whose optimized
# HLO is libtpu's text above: the TPU compile it stands for does not run on this machine.
class _Executable:
    def __init__(self, text: str) -> None:
        self._text = text

    def hlo_modules(self) -> list[Any]:
        return [SimpleNamespace(to_string=lambda: self._text)]


def _built(text: str, held: int = 0) -> tuple[Any, ...]:
    return (_Executable(text), None, SimpleNamespace(notes={"head_barriers": held}), None)


CHEAPER = "\n".join(ln for ln in TEXT.splitlines() if "%fusion.275 =" not in ln)
DEARER = TEXT.replace('"estimated_cycles":"11453811"', '"estimated_cycles":"99453811"')


def _choose(
    base: str, alternative: str | Exception, heads: frozenset[int] = frozenset({50257})
) -> tuple[Any, str, list[str]]:
    calls: list[str] = []

    def build(barriers: bool, tag: str) -> tuple[Any, ...]:
        calls.append(tag)
        assert barriers
        if isinstance(alternative, Exception):
            raise alternative
        return _built(alternative, held=3 if heads else 0)

    built = _built(base)
    chosen, words = _choose_head_barriers(built, build, lambda: heads, "train[0]")  # type: ignore[arg-type]
    return ("alternative" if chosen is not built else "base"), words, calls


def test_the_load_keeps_the_program_the_estimate_prices_lower() -> None:
    kept, words, calls = _choose(TEXT, CHEAPER)
    assert (kept, calls) == ("alternative", ["+head-barriers"])
    assert words.startswith("train[0]: XLA fused the residual stream into the output head "
                            "(fusion.275, a product fusion writing 17 results")  # fmt: skip
    assert words.endswith(": compiled with them")
    assert "at 0.23x the one without (11.5M against 49.7M cycles)" in words

    kept, words, calls = _choose(TEXT, DEARER)
    assert (kept, calls) == ("base", ["+head-barriers"])
    assert words.endswith(": compiled without them")


def test_nothing_is_compiled_twice_without_a_fused_stream_or_a_head() -> None:
    assert _choose(CHEAPER, TEXT) == ("base", "", [])  # no stream fused into a product
    assert _choose(TEXT, CHEAPER, heads=frozenset()) == ("base", "", [])  # no head to hold
    # a fusion of many results that reads and writes nothing of the vocabulary's size
    assert _choose(TEXT, CHEAPER, heads=frozenset({16384})) == ("base", "", [])


def test_a_barriered_program_that_does_not_compile_keeps_the_program() -> None:
    with pytest.warns(StepbundleFallbackWarning, match="weighing them failed"):
        kept, words, calls = _choose(TEXT, RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory"))
    assert (kept, calls) == ("base", ["+head-barriers"])
    assert words == (
        "train[0]: the program with optimization barriers around the output head's products "
        "could not be weighed (RuntimeError: RESOURCE_EXHAUSTED: Ran out of memory): compiled "
        "without them"
    )


def test_the_head_fusion_reads_the_vocabulary() -> None:
    found = fused_stream(TEXT, vocabularies=frozenset({50257}))
    assert found is not None and found.fusion == "fusion.275"  # it reads f32[50257,768]
    assert fused_stream(TEXT, vocabularies=frozenset({16384})) is None
    assert fused_stream(TEXT, vocabularies=frozenset()) is None


def test_the_load_weighs_training_programs_on_one_device_only() -> None:
    from stepbundle.runtime.entry_compiler import EntryCompiler

    def compiler(asked: bool | None, devices: int) -> Any:
        placement = SimpleNamespace(partitioned=devices > 1)
        return EntryCompiler(
            client=None, placement=placement, layout=None, cache=None, matmul_precision=None,
            donate=True, fused_attention=True, head_barriers=asked, initial=None,
        )  # type: ignore[arg-type]  # fmt: skip

    assert compiler(None, 1)._head_barriers(updates_state=True) is None  # weighed
    assert compiler(None, 1)._head_barriers(updates_state=False) is False  # an eval entry
    assert compiler(None, 4)._head_barriers(updates_state=True) is False  # a mesh
    for asked in (True, False):  # as asked, wherever
        assert compiler(asked, 4)._head_barriers(updates_state=False) is asked
