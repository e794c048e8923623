"""Weights-free exports without the model's memory (issue #40): a model built on the meta
device exports to the same bundle as the same model built on the CPU; what needs values
is refused with ``MetaTensorError`` before any tracing; a weights-free export copies no
state tensor.

The model is ``benchmarks/llama.py`` at its ``tiny`` size: rotary tables as non-persistent
buffers, grouped-query SDPA, RMSNorm, SwiGLU, AdamW, bf16 autocast (the 1.1B and 8B of
``benchmarks/export_scale.py`` at toy width).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from stepbundle.export_torch import export
from stepbundle.export_torch.state import state_slots
from stepbundle.frontend.errors import MetaTensorError
from stepbundle.schema import open_bundle
from stepbundle.schema.manifest import SectionKind, StateKind

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import llama  # noqa: E402


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny Llama exported weights-free twice: built on meta, and on the CPU."""
    folder = tmp_path_factory.mktemp("meta")
    out: dict[str, Any] = {}
    for device in ("meta", "cpu"):
        lines: list[str] = []
        ticks: list[tuple[str, int, int | None]] = []
        report = export(
            llama.recipe("tiny", device=device), folder / f"{device}.stepbundle",
            progress=lines.append, check=False if device == "cpu" else None,
            ticker=lambda *a, ticks=ticks: ticks.append(a),
        )  # fmt: skip
        out[device] = (report, lines)
        out[f"{device}-ticks"] = ticks
    return out


def test_the_export_says_which_stage_it_is_in_and_how_far(bundles: dict[str, Any]) -> None:
    ticks = bundles["meta-ticks"]
    stages = list(dict.fromkeys(stage for stage, _, _ in ticks))
    assert stages[:3] == [
        "capturing the training step (1 of 2)",
        "capturing the training step (2 of 2)",
        "comparing the captures, making the training step functional",
    ], stages
    # a capture counts the operators recorded so far; the second, out of the first's count
    first = [(d, t) for stage, d, t in ticks if stage == "capturing the training step (1 of 2)"]
    second = [(d, t) for stage, d, t in ticks if stage == "capturing the training step (2 of 2)"]
    recorded = first[-1][0]
    assert recorded > 100 and all(t is None for _, t in first), first
    assert second[0] == (0, recorded) and second[-1] == (recorded, recorded), second
    # making it functional counts the operators of the functional graph (decomposed: more)
    stage = "comparing the captures, making the training step functional"
    functional = [(d, t) for s, d, t in ticks if s == stage]
    assert functional[-1][0] > recorded and all(t is None for _, t in functional), functional
    lowering = [(d, t) for stage, d, t in ticks if stage == "lowering the train program 0"]
    assert lowering, stages
    total = lowering[-1][1]
    assert total and total > 100  # the tiny Llama's step: hundreds of operators
    assert [d for d, _ in lowering] == sorted(d for d, _ in lowering)
    assert lowering[-1] == (total, total)


def test_stage_line_prints_each_stage_and_its_quarters() -> None:
    import io

    from stepbundle.frontend.progress import StageLine

    out = io.StringIO()
    line = StageLine(out)
    line("capturing the training step (1 of 2)", 0, None)
    for done in range(0, 401, 100):
        line("lowering the train program 0", done, 400)
    line.close()
    got = [
        s.split(" (", 1)[0] if "%" not in s else s.rsplit(",", 1)[0]
        for s in out.getvalue().splitlines()
    ]
    assert got == [
        "[export] capturing the training step",
        "[export] lowering the train program 0",
        "[export] lowering the train program 0: 25% (100/400",
        "[export] lowering the train program 0: 50% (200/400",
        "[export] lowering the train program 0: 75% (300/400",
    ], out.getvalue()


def test_meta_model_exports_the_same_bundle_as_the_cpu_model(bundles: dict[str, Any]) -> None:
    meta, cpu = bundles["meta"][0], bundles["cpu"][0]
    assert meta.digest == cpu.digest
    with open_bundle(meta.path) as b:
        kinds = {e.name: b.manifest.section(e.section).kind for e in b.manifest.state}
        cos = bytes(b.section("state/cos"))
    # weights come from a checkpoint, the rotary tables (code, in no checkpoint) are stored
    assert kinds["embed.weight"] is SectionKind.EXTERNAL
    assert kinds["cos"] is SectionKind.TENSOR
    assert kinds["optimizer.state.embed.weight.exp_avg"] is SectionKind.FILL
    want = llama.rotary_tables(llama.SIZES["tiny"], "cpu")[0]
    assert cos == want.numpy().tobytes()


def test_the_report_prints_in_a_few_lines(bundles: dict[str, Any]) -> None:
    """repr(report) printed the whole manifest (every binding table, thousands of
    characters for a tiny model): it says what a log wants and leaves the manifest out."""
    report = bundles["cpu"][0]
    shown = repr(report)
    assert shown.startswith(f"ExportReport(path={str(report.path)!r}, size={report.size}, ")
    assert f"digest={report.digest!r}" in shown and "entries=('train',)" in shown, shown
    nbytes = sum(s.spec.nbytes for s in report.manifest.state)
    assert f"state={len(report.manifest.state)} tensors of {nbytes} bytes" in shown, shown
    # Not the manifest, nor every stage's and check part's seconds (1,198 characters for
    # the linear example, most of them digits of timings): one line.
    assert "Manifest(" not in shown and "seconds" not in shown and len(shown) < 300, shown
    assert report.manifest.state and report.stage_seconds  # still there as attributes


def test_meta_model_check_is_skipped_and_says_why(bundles: dict[str, Any]) -> None:
    report, lines = bundles["meta"]
    assert report.check is None
    assert any("check skipped: the model is on the meta device" in s for s in lines), lines


def test_meta_model_with_weights_is_refused(tmp_path: Path) -> None:
    r = llama.recipe("tiny", device="meta")
    r.include_state = True
    with pytest.raises(MetaTensorError, match="include_state=False"):
        export(r, tmp_path / "x.stepbundle")
    assert not (tmp_path / "x.stepbundle").exists()


def test_meta_rotary_tables_are_refused_naming_the_buffer(tmp_path: Path) -> None:
    cfg = llama.SIZES["tiny"]
    r = llama.recipe(cfg, device="meta")
    r.model.cos = torch.empty_like(r.model.cos, device="meta")  # as torch.device("meta") left it
    with pytest.raises(MetaTensorError, match="'cos'.*persistent=False.*device='cpu'"):
        export(r, tmp_path / "x.stepbundle")


def test_a_meta_code_buffer_of_a_real_model_is_refused_with_weights_too(tmp_path: Path) -> None:
    # state_dict() leaves non-persistent buffers out: a model whose weights are real but
    # whose rotary table is on meta is refused by name, not by the writer's raw error
    r = llama.recipe("tiny", device="cpu")
    r.include_state = True
    r.model.cos = torch.empty_like(r.model.cos, device="meta")
    with pytest.raises(MetaTensorError, match="'cos'.*persistent=False"):
        export(r, tmp_path / "x.stepbundle", check=False)
    assert not (tmp_path / "x.stepbundle").exists()


def test_meta_model_check_true_is_refused(tmp_path: Path) -> None:
    # refused before tracing
    with pytest.raises(MetaTensorError, match="check=False"):
        export(llama.recipe("tiny", device="meta"), tmp_path / "x.stepbundle", check=True)


def test_weights_free_slots_copy_nothing() -> None:
    r = llama.recipe("tiny", device="cpu")
    slots = {s.name: s for s in state_slots(r, zero_grads=True)}
    params = dict(r.model.named_parameters())
    for name, p in params.items():
        assert slots[name].value.data_ptr() == p.data_ptr(), name  # the user's own tensor
    made = [s for s in slots.values() if s.kind in (StateKind.OPTIMIZER_STATE, StateKind.GRADIENT)]
    assert made
    for s in made:
        if s.value.dim():  # one element expanded: no memory of its size
            assert all(st == 0 for st in s.value.stride()), s.name
            assert s.value.untyped_storage().nbytes() == s.value.element_size(), s.name
        assert bool((s.value == 0).all()), s.name
    with_weights = llama.recipe("tiny", device="cpu")
    with_weights.include_state = True
    copied = {s.name: s for s in state_slots(with_weights, zero_grads=True)}
    p = dict(with_weights.model.named_parameters())["embed.weight"]
    assert copied["embed.weight"].value.data_ptr() != p.data_ptr()


def test_the_writer_refuses_any_meta_value_in_a_weights_holding_bundle() -> None:
    # the last line for what no earlier refusal names (optimizer state the user left on
    # meta): MetaTensorError naming the tensor, not torch's "Cannot copy out of meta tensor"
    from stepbundle.export_torch.state import Slot
    from stepbundle.frontend.initial_state import initial_section

    s = Slot("optimizer.state.w.exp_avg", StateKind.OPTIMIZER_STATE, torch.empty(3, device="meta"))
    with pytest.raises(MetaTensorError, match="'optimizer.state.w.exp_avg' is on the meta"):
        initial_section(s, s.value, include_state=True, non_persistent=set())


def test_meta_optimizer_state_of_a_real_model_is_refused_before_tracing(tmp_path: Path) -> None:
    # a weights-holding export whose optimizer state was left on meta: refused by name
    # when the state is collected, before the step is captured (it reached the writer,
    # after both captures, before)
    r = llama.recipe("tiny", device="cpu")
    r.include_state = True
    for p in r.model.parameters():
        r.optimizer.state[p] = {
            "step": torch.zeros((), device="meta"),
            "exp_avg": torch.empty_like(p, device="meta"),
            "exp_avg_sq": torch.empty_like(p, device="meta"),
        }
    with pytest.raises(MetaTensorError, match=r"'optimizer\.state\.embed\.weight\.step'"):
        state_slots(r, zero_grads=True)
    ticks: list[tuple[str, int, int | None]] = []
    with pytest.raises(MetaTensorError, match="include_state=False"):
        export(r, tmp_path / "x.stepbundle", check=False, ticker=lambda *a: ticks.append(a))
    assert not any(stage.startswith("capturing") for stage, _, _ in ticks), ticks
    assert not (tmp_path / "x.stepbundle").exists()
