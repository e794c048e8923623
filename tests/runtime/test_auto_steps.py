"""``--steps-per-call auto``: K chosen from a measured step time, never changing a number.

The rule (runtime/auto_steps.py) is a pure function of the measured time and the cadences;
the CLI tests run it for real on the CPU, where a golden step is dispatch-bound, and hold
the run to the same run at one step per call, byte for byte.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import GOLDEN_DIR, golden_bundle

from stepbundle.runtime.auto_steps import choose

NAME = "linear_adamw"


@pytest.mark.parametrize(
    ("step_ms", "cadences", "want"),
    [
        (0.2, (), 32),
        (0.999, (0, 0), 32),
        (1.0, (), 8),
        (2.9, (), 8),
        (3.0, (), 1),
        (40.0, (), 1),
        (0.2, (24,), 8),  # 32 and 16 do not divide 24
        (0.2, (100, 0), 4),
        (0.2, (64, 48), 16),
        (2.0, (12,), 4),
        (0.2, (7,), 1),
    ],
)
def test_the_rule(step_ms: float, cadences: tuple[int, ...], want: int) -> None:
    k, reason = choose(step_ms, cadences)
    assert k == want
    assert all(c % k == 0 for c in cadences if c)
    assert ("not dispatch-bound" in reason) == (step_ms >= 3.0)
    # A K the cadence lowered says so, with the K the time alone would give.
    assert ("lowered to" in reason) == (k > 1 and k < choose(step_ms)[0]), reason


def _run(
    tmp_path: Path, name: str, *extra: str, cache: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """48 steps of the golden bundle, metrics as JSON, the state saved as NAME.safetensors;
    with ``cache`` that compile cache, else none."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "stepbundle",
            "run",
            str(golden_bundle(NAME)),
            "--data",
            str(GOLDEN_DIR / f"{NAME}.inputs.npz"),
            "--steps",
            "48",
            "--json",
            *(["--cache-dir", str(cache)] if cache else ["--no-cache"]),
            "--save-state",
            str(tmp_path / f"{name}.safetensors"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_auto_measures_chooses_and_changes_no_number(tmp_path: Path) -> None:
    auto = _run(
        tmp_path,
        "auto",
        "--steps-per-call",
        "auto",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "24",
    )
    one = _run(tmp_path, "one", "--steps-per-call", "1")
    assert auto.returncode == 0, auto.stderr
    assert one.returncode == 0, one.stderr
    found = re.search(
        r"\[run\] steps per call (\d+) \(auto: ([\d.]+) ms/step at 1 per call", auto.stderr
    )
    assert found, auto.stderr
    k, ms = int(found.group(1)), float(found.group(2))
    # A golden step is dispatch-bound on any CPU (0.2 ms here): K = 1 would make the
    # byte-for-byte comparison below compare single steps with single steps.
    assert k > 1, auto.stderr
    assert ms > 0 and 24 % k == 0
    assert k == choose(ms, (24,))[0]
    assert f"{k} per call (auto)" in auto.stderr
    assert "(auto" not in one.stderr and "1 per call)" in one.stderr
    assert auto.stdout == one.stdout  # every step's metrics, bit for bit
    assert len(one.stdout.splitlines()) == 48
    a = (tmp_path / "auto.safetensors").read_bytes()
    assert a == (tmp_path / "one.safetensors").read_bytes()


def test_the_probe_is_held_to_the_expected_digest(tmp_path: Path) -> None:
    """The probe compiles and runs the bundle, so a bundle of the wrong digest must be
    refused before it: nothing compiled, nothing in the compile cache."""
    cache = tmp_path / "cache"
    wrong = "sha256:" + "0" * 64
    out = _run(tmp_path, "x", "--steps-per-call", "auto", "--expect-digest", wrong, cache=cache)
    assert out.returncode == 1, out.stderr
    assert "not the expected sha256:000" in out.stderr
    assert "steps per call" not in out.stderr
    assert not cache.exists() or not any(cache.rglob("*.xla")), list(cache.rglob("*"))


def test_the_cpu_default_is_one_step_per_call(tmp_path: Path) -> None:
    out = _run(tmp_path, "default")
    assert out.returncode == 0, out.stderr
    assert "1 per call)" in out.stderr and "auto" not in out.stderr


def test_a_check_every_step_keeps_k_at_one(tmp_path: Path) -> None:
    out = _run(tmp_path, "nan", "--steps-per-call", "auto", "--stop-on-nonfinite")
    assert out.returncode == 0, out.stderr
    assert "steps per call 1 (auto: --stop-on-nonfinite checks every step)" in out.stderr


def test_a_bad_value_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stepbundle", "run", "x", "--steps-per-call", "some"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--steps-per-call" in out.stderr


def test_load_options_auto_probes_for_python_users_too() -> None:
    """``LoadOptions(steps_per_call="auto")`` is the same policy as ``run``'s, without the
    CLI: the golden step is dispatch-bound on any CPU, so K > 1, and load_info says why."""
    from stepbundle.runtime import CompileOptions, LoadOptions, load

    options = LoadOptions(compile=CompileOptions(steps_per_call="auto"))
    trainer = load(golden_bundle(NAME), "cpu", options=options)
    found = re.fullmatch(
        r"steps per call (\d+) \(auto: ([\d.]+) ms/step at 1 per call, dispatch-bound\)",
        trainer.load_info.auto_steps,
    )
    assert found, trainer.load_info.auto_steps
    k, ms = int(found.group(1)), float(found.group(2))
    assert trainer.steps_per_call == k == choose(ms)[0] > 1
    eight = LoadOptions(compile=CompileOptions(steps_per_call=8))
    given = load(golden_bundle(NAME), "cpu", options=eight)
    assert given.load_info.auto_steps == "" and given.steps_per_call == 8


def test_auto_runs_nothing_where_the_load_runs_no_training_step() -> None:
    """compile_only places no state and an eval-only load has no train program: "auto"
    measures nothing there (no state read, no train entry compiled) and says so."""
    from stepbundle.runtime import CompileOptions, LoadOptions, load

    only = LoadOptions(compile=CompileOptions(steps_per_call="auto", compile_only=True))
    compiled = load(golden_bundle(NAME), "cpu", options=only)
    assert (
        compiled.load_info.auto_steps
        == "steps per call 1 (auto: compile_only runs no step to measure)"
    )
    assert compiled.steps_per_call == 1
    ev = LoadOptions(compile=CompileOptions(steps_per_call="auto", entries="eval"))
    trainer = load(golden_bundle(NAME), "cpu", options=ev)
    assert trainer.load_info.auto_steps == "steps per call 1 (auto: the train entry is not loaded)"
    assert trainer.steps_per_call == 1


def test_the_cadences_are_the_librarys_for_python_and_the_command() -> None:
    """``CompileOptions(cadences=...)`` keeps the K that "auto" chooses a divisor of each;
    ``stepbundle run`` passes "auto" with its checkpoint and evaluation cadences, so the
    choice is the library's and ``load_info.auto_steps`` records it for the command too."""
    from stepbundle.cli.config import RunConfig
    from stepbundle.cli.run import _open_trainer
    from stepbundle.runtime import CompileOptions, LoadOptions, UsageError, load

    pattern = r"steps per call (\d+) \(auto: ([\d.]+) ms/step at 1 per call, (.*)\)"
    options = CompileOptions(steps_per_call="auto", cadences=(12, 0))
    trainer = load(golden_bundle(NAME), "cpu", options=LoadOptions(compile=options))
    command = _open_trainer(
        RunConfig(
            command="run",
            bundle=str(golden_bundle(NAME)),
            data=str(GOLDEN_DIR / f"{NAME}.inputs.npz"),
            steps_per_call="auto",
            checkpoint_every=12,
            no_cache=True,
        )
    )
    for loaded in (trainer, command):
        found = re.fullmatch(pattern, loaded.load_info.auto_steps)
        assert found, loaded.load_info.auto_steps
        k, ms = int(found.group(1)), float(found.group(2))
        assert loaded.steps_per_call == k == choose(ms, (12,))[0] and 12 % k == 0
        assert found.group(3) == choose(ms, (12,))[1]  # "lowered to 4" where 32 was measured
    assert CompileOptions(cadences=12).cadences == (12,)  # type: ignore[arg-type]
    for bad in ((-1,), (True,), (2.5,), ("12",)):
        with pytest.raises(UsageError, match="cadences must be step counts"):
            CompileOptions(cadences=bad)  # type: ignore[arg-type]
