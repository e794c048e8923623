"""``CompileOptions(matmul_precision=...)``: the setting reaches every matmul, keys the cache, and
changes nothing on the CPU.

The oracle for the attribute is MLIR's own printed text of the rewritten module; for the
results, the same bundle loaded as exported (no precision set) with the cache off.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import cli_here, golden_batches, golden_bundle

import stepbundle.schema as codec
from stepbundle.runtime import CompileOptions, LoadOptions, UsageError, load
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.precision import set_matmul_precision

NAME = "linear_adamw"
BUNDLE = golden_bundle(NAME)


def _losses(trainer: object) -> list[float]:
    return [float(m["loss"]) for m in trainer.run(golden_batches(NAME), 3)]  # type: ignore[attr-defined]


def _train_module() -> mlir.Module:
    bundle = codec.open_bundle(BUNDLE)
    program = bundle.manifest.entries["train"].programs[0]
    return mlir.parse_artifact(bundle.section(program.section))


@pytest.mark.parametrize("precision", ["default", "high", "highest"])
def test_every_dot_general_carries_the_precision(precision: str) -> None:
    module = _train_module()
    dots = len(re.findall(r"stablehlo\.dot_general", module.text()))
    assert dots > 0
    assert set_matmul_precision(module, precision) == dots
    text = module.text()
    want = f"precision = [{precision.upper()}, {precision.upper()}]"
    assert text.count(want) == dots, text
    assert text.count("precision = [") == dots


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="default, high, highest"):
        set_matmul_precision(_train_module(), "tf32")
    with pytest.raises(UsageError, match="matmul_precision must be one of"):
        load(
            BUNDLE,
            options=LoadOptions(compile=CompileOptions(matmul_precision="fast")),
        )


def test_results_are_bit_identical_on_cpu_across_precisions() -> None:
    want = _losses(
        load(
            BUNDLE,
            options=LoadOptions(compile=CompileOptions(matmul_precision="default")),
        )
    )
    for precision in ("high", "highest"):
        got = _losses(
            load(
                BUNDLE,
                options=LoadOptions(compile=CompileOptions(matmul_precision=precision)),
            )
        )
        np.testing.assert_array_equal(np.array(got), np.array(want), err_msg=precision)


def test_a_cached_executable_is_never_reused_for_another_precision(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = load(
        BUNDLE,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=cache, entries="train", matmul_precision="highest")
        ),
    )
    assert first.load_info.compiled > 0 and first.load_info.cache_hits == 0
    again = load(
        BUNDLE,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=cache, entries="train", matmul_precision="highest")
        ),
    )
    assert again.load_info.compiled == 0 and again.load_info.cache_hits == first.load_info.compiled
    for other in ("high", "default"):
        t = load(
            BUNDLE,
            options=LoadOptions(
                compile=CompileOptions(cache_dir=cache, entries="train", matmul_precision=other)
            ),
        )
        assert t.load_info.cache_hits == 0, other
        assert t.load_info.compiled == first.load_info.compiled, other
    # None is the manifest's value: the entries just compiled for it are hits.
    recorded = codec.open_bundle(BUNDLE).manifest.matmul_precision
    t = load(BUNDLE, options=LoadOptions(compile=CompileOptions(cache_dir=cache, entries="train")))
    assert t.load_info.matmul_precision == recorded
    assert t.load_info.cache_hits == first.load_info.compiled and t.load_info.compiled == 0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepbundle", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_inspect_shows_and_run_takes_the_precision() -> None:
    shown = _cli("inspect", str(BUNDLE))
    assert shown.returncode == 0, shown.stderr
    assert "matmul    precision default" in shown.stdout
    data = str(BUNDLE.parent / f"{NAME}.inputs.npz")
    out = _cli(
        "run", str(BUNDLE), "--steps", "2", "--data", data, "--json",
        "--matmul-precision", "highest",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    want = _losses(load(BUNDLE))[:2]
    assert [json.loads(line)["loss"] for line in out.stdout.splitlines()] == want
    bad = cli_here("run", str(BUNDLE), "--steps", "1", "--data", data, "--matmul-precision", "tf32")
    assert bad.returncode != 0 and "--matmul-precision" in bad.stderr


def test_dot_and_convolution_carry_the_precision_too() -> None:
    """Ops torch_xla does not write but another producer may: the older stablehlo.dot
    and a convolution (in the generic form, as MLIR prints it back)."""
    text = """
    func.func @main(%a: tensor<2x3xf32>, %b: tensor<3x4xf32>, %x: tensor<1x1x5x5xf32>,
                    %k: tensor<1x1x3x3xf32>) -> (tensor<2x4xf32>, tensor<1x1x3x3xf32>) {
      %d = "stablehlo.dot"(%a, %b) : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
      %c = stablehlo.convolution(%x, %k) dim_numbers = [b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1],
             window = {stride = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64}
             : (tensor<1x1x5x5xf32>, tensor<1x1x3x3xf32>) -> tensor<1x1x3x3xf32>
      return %d, %c : tensor<2x4xf32>, tensor<1x1x3x3xf32>
    }
    """
    module = mlir.Module.parse_text(_train_module(), text)
    assert set_matmul_precision(module, "highest") == 2
    assert (
        module.text().count("precision = [HIGHEST, HIGHEST]")
        + module.text().count(
            "precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
        )
        == 2
    ), module.text()


def test_a_bundle_older_than_the_field_keeps_its_programs_own_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Format 1.1 records no precision (it decodes as "default"), but torch_xla wrote a
    non-default one into the ops themselves: overwriting it with DEFAULT would move such
    a bundle to TF32 on a GPU. Nothing is set unless the user asks."""
    from runtime_helpers import golden_bundle as golden

    import stepbundle.runtime.compile.rewrites as program_module

    calls: list[str] = []
    real = program_module.set_matmul_precision

    def spy(module: mlir.Module, precision: str) -> int:
        calls.append(precision)
        return real(module, precision)

    monkeypatch.setattr(program_module, "set_matmul_precision", spy)
    old = golden(NAME, (1, 1))
    t = load(old, options=LoadOptions(compile=CompileOptions(entries="train")))
    assert t.load_info.matmul_precision is None and calls == []
    t = load(
        old,
        options=LoadOptions(compile=CompileOptions(entries="train", matmul_precision="highest")),
    )
    assert t.load_info.matmul_precision == "highest" and calls and set(calls) == {"highest"}
    t = load(
        BUNDLE, options=LoadOptions(compile=CompileOptions(entries="train"))
    )  # 1.2 records one: it is applied
    assert calls[-1] == codec.open_bundle(BUNDLE).manifest.matmul_precision
