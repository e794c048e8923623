"""The CLI's one frozen run configuration (cli/config.py) and the schedule rule it leaves
to the library (runtime/train/schedule.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from stepbundle.cli.config import RunConfig
from stepbundle.cli.main import build_parser
from stepbundle.runtime.train.schedule import named_schedule, schedule_clash


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "b.stepbundle", "--data", "d.npz", "--steps", "3", "--set", "lr=0.1"],
        ["eval", "b.stepbundle", "--data", "d.npz"],
        ["compile", "b.stepbundle", "--entry", "train", "--entry", "eval"],
    ],
)
def test_every_option_of_run_eval_and_compile_has_a_field(argv: list[str]) -> None:
    config = RunConfig.from_args(build_parser().parse_args(argv))
    assert config.command == argv[0] and config.bundle == "b.stepbundle"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bundle = "other"  # type: ignore[misc]


def test_the_options_become_values_of_the_record() -> None:
    run = RunConfig.from_args(
        build_parser().parse_args(
            ["run", "b", "--data", "d", "--steps", "2", "--set", "lr=0.5", "--lr-schedule", "x"]
        )
    )
    assert run.set_values == (("lr", 0.5),) and run.lr_schedule == ("x",)
    assert run.pack_state == 65536 and run.steps_per_call is None
    compile_ = RunConfig.from_args(
        build_parser().parse_args(["compile", "b", "--entry", "train", "--entry", "eval"])
    )
    assert compile_.entries == ("train", "eval") and compile_.steps_per_call == 1
    # eval has no --pack-state: the runtime's default, as before the record
    assert RunConfig.from_args(build_parser().parse_args(["eval", "b", "--data", "d"])).pack_state


def test_an_option_without_a_field_is_refused_not_dropped() -> None:
    args = argparse.Namespace(command="run", bundle="b", new_option=3)
    with pytest.raises(TypeError, match="no field for new_option"):
        RunConfig.from_args(args)


def test_the_shared_options_are_declared_once() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    declared = {
        name: {a.option_strings[0]: a for a in sub.choices[name]._actions if a.option_strings}
        for name in ("run", "eval", "compile")
    }
    for flag in ("--devices", "--layout", "--pack-state", "--coordinator", "--matmul-precision"):
        kinds = {
            (a.type, a.default, a.metavar) for n in ("run", "compile") for a in [declared[n][flag]]
        }
        assert len(kinds) == 1, (flag, kinds)
    assert declared["eval"]["--devices"].type is declared["run"]["--devices"].type


def test_the_schedule_rule() -> None:
    assert named_schedule("warmup_cosine:peak=1e-3,warmup=1,total=9") == (
        "lr",
        "warmup_cosine:peak=1e-3,warmup=1,total=9",
    )
    assert named_schedule("betas.0=linear:start=0.9,end=0.8,total=5") == (
        "betas.0",
        "linear:start=0.9,end=0.8,total=5",
    )
    restored = {"lr": "constant:value=0.1", "optimizer.betas.0": "constant:value=0.9", "wd": None}
    assert schedule_clash(restored, "lr", "constant:value=0.1") is None  # the same spec
    assert schedule_clash(restored, "lr", "constant:value=0.2") == ("lr", "constant:value=0.1")
    assert schedule_clash(restored, "betas.0", "constant:value=0.8") == (
        "optimizer.betas.0",
        "constant:value=0.9",
    )
    assert schedule_clash(restored, "wd", "constant:value=0.0") is None  # a Python function's
    assert schedule_clash({}, "lr", "constant:value=0.2") is None  # a fresh run


# One argv per subcommand with its required arguments, so that only --bogus is wrong.
_MINIMAL = {
    "export": ["r.py:f", "-o", "x"],
    "run": ["b", "--data", "d", "--steps", "1"],
    "eval": ["b", "--data", "d"],
    "inspect": ["b"],
    "verify": ["b"],
    "pull": ["b"],
    "compile": ["b"],
}


def test_an_unknown_argument_is_refused_by_its_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: argparse reported it from the top parser, 'stepbundle: error:
    unrecognized arguments: --bogus (see stepbundle --help)', whose help lists commands."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(_MINIMAL)  # a new subcommand: add its minimal argv
    for name, argv in _MINIMAL.items():
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([name, *argv, "--bogus"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err == (
            f"stepbundle {name}: error: unrecognized arguments: --bogus "
            f"(see stepbundle {name} --help)\n"
        ), err
    build_parser().parse_args(["eval", *_MINIMAL["eval"]])  # and without it, no refusal
