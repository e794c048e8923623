"""A wrong argument is the caller's to fix: a ``UsageError`` for a Python caller, naming
what was wrong and what would do, and exit 2 for the command (docs/cli.md, "Exit codes"),
whether the command finds it while parsing or the library finds it while loading.

Here: a bundle path with no file, a layout that does not parse, a ``--resume`` that does
not exist, and a schedule that would replace the one a resumed checkpoint continues
(``Trainer.set_schedule``, the one rule for the command and for Python callers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import GOLDEN_DIR, golden_batches, golden_bundle

from stepbundle.cli.main import main
from stepbundle.runtime import (
    BundleError,
    BundleNotFoundError,
    CompileOptions,
    LoadOptions,
    UsageError,
    load,
)

NAME = "linear_adamw"
SCHEDULED = "batchnorm_lr"  # an lr the bundle declares (Adam)
NO_CACHE = LoadOptions(compile=CompileOptions(cache_dir=False))
OLD = "constant:value=0.01"
NEW = "linear:start=0.01,end=0.001,total=10"


def _command(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``stepbundle ARGV`` in this process: its exit code and the last line on stderr."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's refusals
        code = e.code if isinstance(e.code, int) else 1
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_a_missing_bundle_is_a_usage_error_that_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.stepbundle"
    with pytest.raises(BundleNotFoundError) as e:
        load(missing, options=NO_CACHE)
    message = str(e.value)
    assert f"There is no bundle at {str(missing)!r}: no such file." in message, message
    assert "stepbundle export" in message and "sha256:<digest>" in message
    # A UsageError, and still the FileNotFoundError callers caught before, not a BundleError
    # (nothing is wrong with any bundle).
    assert isinstance(e.value, UsageError) and isinstance(e.value, FileNotFoundError)
    assert not isinstance(e.value, BundleError)
    assert e.value.filename == str(missing) and e.value.strerror == "No such file or directory"
    assert not message.startswith("[Errno")
    # A relative path says where it was looked for; a missing folder is named.
    with pytest.raises(FileNotFoundError, match=r"relative to .*its folder 'nowhere' does not"):
        load("nowhere/b.stepbundle", options=NO_CACHE)
    # The steps_per_call="auto" probe opens the bundle first: the same refusal.
    auto = LoadOptions(compile=CompileOptions(cache_dir=False, steps_per_call="auto"))
    with pytest.raises(BundleNotFoundError, match="There is no bundle at"):
        load(missing, options=auto)


def test_options_that_are_not_a_load_options_are_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"takes its options as a LoadOptions, got dict\."):
        load(golden_bundle(NAME), options={"steps_per_call": 8})  # type: ignore[arg-type]


def test_the_command_exits_2_for_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bundle, data = str(golden_bundle(NAME)), str(GOLDEN_DIR / f"{NAME}.inputs.npz")
    run = ["run", bundle, "--data", data, "--steps", "1"]
    # Found by the library at load (ParallelOptions), before anything is compiled.
    for command in (run, ["eval", bundle, "--data", data]):
        code, line = _command(capsys, *command, "--layout", "fsdpp")
        assert code == 2, line
        assert line.startswith("stepbundle: error: Unknown layout part 'fsdpp'"), line
    code, line = _command(capsys, "compile", bundle, "--layout", "fsdpp")
    assert code == 2 and "Unknown layout part 'fsdpp'" in line, line
    # Found while parsing: a checkpoint (or folder) that is not there.
    for resume in (str(tmp_path / "missing") + "/", str(tmp_path / "missing.safetensors")):
        code, line = _command(capsys, *run, "--resume", resume)
        assert code == 2, line
        assert f"--resume {resume!r} does not exist" in line, line
        assert "--checkpoint-dir folder of an earlier run" in line
    # eval names --resume itself, not "cannot read --data" (as it did for an empty folder).
    empty = tmp_path / "empty"
    empty.mkdir()
    evaluate = ["eval", bundle, "--data", data]
    for resume, said in (
        (str(tmp_path / "missing.safetensors"), "does not exist"),
        (str(empty), "holding no checkpoint"),
    ):
        code, line = _command(capsys, *evaluate, "--resume", resume)
        assert code == 2 and line.startswith(f"stepbundle: error: --resume {resume!r}"), line
        assert said in line, line
    # A bundle with no file: refused before the load by run, by the library for compile.
    missing = str(tmp_path / "missing.stepbundle")
    code, line = _command(capsys, "compile", missing)
    assert code == 2 and f"There is no bundle at {missing!r}" in line, line
    code, line = _command(capsys, "run", missing, "--data", data, "--steps", "1")
    assert code == 2 and missing in line and "No such file" in line, line


@pytest.fixture(scope="module")
def resumable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose lr follows the spec OLD, one step in."""
    trainer = load(golden_bundle(SCHEDULED))
    trainer.set_schedule("lr", OLD)
    trainer.step(golden_batches(SCHEDULED)[0])
    path = tmp_path_factory.mktemp("sched") / "step1.safetensors"
    trainer.save_checkpoint(path)
    return path


def test_a_resumed_trainer_refuses_to_replace_its_schedule(resumable: Path) -> None:
    trainer = load(golden_bundle(SCHEDULED))
    trainer.set_schedule("lr", NEW)  # a fresh trainer continues nothing: any schedule
    trainer.load_checkpoint(resumable)
    restored = trainer.schedules
    assert set(restored.values()) == {OLD}, restored
    full = next(iter(restored))
    with pytest.raises(UsageError) as e:
        trainer.set_schedule("lr", NEW)
    assert str(e.value) == (
        f"The schedule {NEW!r} for 'lr' conflicts with the checkpoint, whose {full!r} follows "
        f"{OLD!r}. A resumed run continues the checkpoint's schedule: give the same spec, or "
        "none (drop --lr-schedule, or the set_schedule call); from Python, "
        "set_schedule(name, schedule, replace=True) replaces it on purpose."
    )
    with pytest.raises(UsageError, match="A Python function as the schedule for 'lr' conflicts"):
        trainer.set_schedule("lr", lambda step: 0.01)
    with pytest.raises(UsageError, match="Unknown schedule 'cosine'"):  # a bad spec first
        trainer.set_schedule("lr", "cosine:peak=1")
    assert trainer.schedules == restored  # each refusal changed nothing
    trainer.set_schedule("lr", OLD)  # the same spec: what the run continues anyway
    assert trainer.schedules == restored
    trainer.set_schedule("lr", NEW, replace=True)
    assert set(trainer.schedules.values()) == {NEW}
    trainer.set_schedule("lr", OLD)  # replaced once, the schedule is the caller's own
    # Removing a schedule is never a clash; a second resume restores the rule.
    trainer.load_checkpoint(resumable)
    trainer.set_schedule("lr", None)
    assert trainer.schedules == {}
    trainer.set_schedule("lr", NEW)


def test_the_command_leaves_the_clash_to_the_trainer(
    capsys: pytest.CaptureFixture[str], resumable: Path, tmp_path: Path
) -> None:
    data = str(GOLDEN_DIR / f"{SCHEDULED}.inputs.npz")
    run = ["run", str(golden_bundle(SCHEDULED)), "--data", data, "--steps", "1"]
    out = tmp_path / "after.safetensors"
    code, line = _command(
        capsys, *run, "--resume", str(resumable), "--lr-schedule", NEW, "--save-state", str(out)
    )
    assert code == 2, line
    assert line.startswith(f"stepbundle: error: The schedule {NEW!r} for 'lr' conflicts"), line
    assert not out.exists()
    code, line = _command(capsys, *run, "--resume", str(resumable), "--lr-schedule", OLD)
    assert code == 0, line


def test_eval_takes_the_digest_pin_and_the_load_options_run_takes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    bundle = golden_bundle(NAME)
    data = str(GOLDEN_DIR / f"{NAME}.inputs.npz")
    assert main(["inspect", str(bundle), "--json"]) == 0
    digest = json.loads(capsys.readouterr().out)["digest"]
    other = "sha256:" + "0" * 64
    evaluate = ["eval", str(bundle), "--data", data, "--entry", "eval", "--no-cache"]
    code, line = _command(capsys, *evaluate, "--expect-digest", other)
    assert code == 1, line  # refused: another bundle than the one pinned
    assert "Refusing to run a different bundle than the one pinned" in line, line
    import stepbundle.runtime as runtime

    seen: list[Any] = []
    real = runtime.load

    def load(*args: Any, **kwargs: Any) -> Any:  # the real load, its options kept
        seen.append(kwargs["options"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "load", load)
    for extra in (
        ["--expect-digest", digest],
        ["--matmul-precision", "highest"],
        ["--pack-state", "0"],
        ["--no-bf16-products", "--no-regather-weights"],
        ["--regather-weights", "on"],
    ):
        code, line = _command(capsys, *evaluate, *extra)
        assert code == 0, (extra, line)
    pinned, precise, unpacked, as_written, regathered = seen
    assert as_written.compile.regather_weights is False
    assert regathered.compile.regather_weights is True
    assert pinned.compile.regather_weights == "auto"  # the rewrite only where needed
    assert pinned.safety.expect_digest == digest
    assert precise.compile.matmul_precision == "highest"
    assert unpacked.state.pack_state == 0
    assert as_written.compile.bf16_products is False and pinned.compile.bf16_products is True
