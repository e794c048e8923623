"""The ``stepbundle`` command: export, run, eval, inspect, verify, pull, compile.

Everything but ``export`` works without torch; ``export`` imports the exporter
(torch, torch_xla) only when it is called. Each subcommand lives in its own module; this
one holds the argument parser and ``main``. The options ``run``, ``eval`` and ``compile``
share are declared once (``options.py``), and those commands turn their arguments into
one frozen ``RunConfig`` (``config.py``) that they pass by value; what a run does is the
runtime's policy (``runtime/auto_steps.py``, ``runtime/train/schedule.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from stepbundle._version import __version__

from . import args as types
from .common import EXIT_PIPE_CLOSED
from .evaluate import cmd_eval
from .export import cmd_export
from .inspect import cmd_inspect, cmd_verify
from .options import JOB, add, add_device_options, add_init_options
from .prepare import add_compile, add_pull
from .run import cmd_run

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line: ``run``'s usage alone is 20 lines, printed
    before the error it buried. ``--help`` still prints all of it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """argparse reports arguments no subcommand knows from the top parser, naming
        ``stepbundle`` and its help; they belong to the subcommand's usage."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner: argparse.ArgumentParser = self
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction):
                    owner = action.choices.get(str(getattr(parsed, action.dest, "")), self)
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stepbundle", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"stepbundle {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    _add_export(sub)
    _add_run(sub)
    _add_eval(sub)
    i = sub.add_parser("inspect", help="summarize a bundle (--full: every binding and section)")
    i.add_argument("bundle", help=_BUNDLE_HELP)
    i.add_argument("--json", action="store_true")
    i.add_argument(
        "--full", action="store_true", help="every input, output, state tensor and section"
    )
    i.set_defaults(fn=cmd_inspect)

    v = sub.add_parser("verify", help="check every digest of a bundle")
    v.add_argument("bundle", help=_BUNDLE_HELP)
    v.set_defaults(fn=cmd_verify)
    add_pull(sub)
    add_compile(sub)
    return p


_BUNDLE_HELP = (
    "the bundle: a file, a URL (https://, file://; gs://, s3://, ... with their fsspec "
    "backend installed), fetched once into the local store, or sha256:<digest> of a bundle "
    "in the store"
)


def _add_export(sub: Any) -> None:
    """``stepbundle export``."""
    e = sub.add_parser(
        "export", help="trace a recipe's training step and write a bundle (needs torch)"
    )
    e.add_argument("recipe", help="FILE.py:FUNC returning a stepbundle.exporter.Recipe")
    e.add_argument("-o", "--output", required=True, help="bundle file to write")
    e.add_argument(
        "--emit-mlir", metavar="DIR", help="also write each program as .mlir text into DIR"
    )
    e.add_argument(
        "--no-state",
        action="store_true",
        help="write a bundle without weights (Recipe(include_state=False)): runs take them "
        "from a checkpoint (stepbundle run --init-from); a fresh optimizer's state is "
        "described by rule",
    )
    e.add_argument(
        "--no-check",
        action="store_true",
        help="skip the export check (by default the bundle's first step is run once on the "
        "CPU through the runtime and compared with one eager PyTorch step; skip it for a "
        "model too big to step on this machine's CPU)",
    )
    e.add_argument(
        "--frontend",
        choices=("auto", "torch_xla", "torch"),
        default="auto",
        help="what captures the step: torch_xla (stepbundle[export]: torch 2.9 + torch_xla), "
        "torch (stepbundle[export-torch]: current torch and jax, no torch_xla), or auto: "
        "torch_xla when it is installed, else torch (the choice is printed)",
    )
    e.set_defaults(fn=cmd_export)


def _add_run(sub: Any) -> None:
    """``stepbundle run``: the options of a run, its outputs and its job."""
    r = sub.add_parser("run", help="run a bundle's steps (no torch needed)")
    r.add_argument("bundle", help=_BUNDLE_HELP)
    how_long = r.add_mutually_exclusive_group(required=True)
    how_long.add_argument(
        "--steps",
        type=types.at_least(1),
        help="steps this run takes (after --resume: more steps from the checkpoint's), "
        "e.g. --steps 1000",
    )
    how_long.add_argument(
        "--until-step",
        type=types.at_least(1),
        metavar="N",
        help="run until the global step count is N: the same command resumed from any "
        "checkpoint ends at the same step, e.g. --until-step 10000",
    )
    r.add_argument(
        "--data",
        required=True,
        help="an .npz with one (S, *shape) array per batch input (step i uses batch i %% S), "
        "or a dataset folder (dataset.json + .npy shards; see examples/write_dataset.py), "
        "read from disk, shuffled per epoch, or a .npy of token ids (one 1-D integer array) "
        "for a language model: windows of the bundle's context at random offsets drawn "
        "from --shuffle-seed",
    )
    _add_data_options(r)
    r.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    r.add_argument(
        "--log-every",
        type=types.at_least(1),
        metavar="N",
        help="report every N-th step (and the last) in --json and plain lines, "
        "--metrics-file and --tensorboard, e.g. --log-every 100. Default: every step, plain "
        "lines about ten per run. A reported step waits for the device to finish it",
    )
    r.add_argument(
        "--metrics-file",
        metavar="PATH",
        help="append one JSON object per reported step to PATH: global step, seconds since "
        'start, lr and every metric, e.g. --metrics-file runs/a/metrics.jsonl ("NaN", '
        '"Infinity" as strings)',
    )
    r.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="write TensorBoard scalars (train/<metric>, hyperparameters/<name>) for each "
        "reported step into DIR, e.g. --tensorboard runs/a (needs pip install "
        "'stepbundle[tensorboard]')",
    )
    r.add_argument("--save-state", metavar="OUT.safetensors", help="write the final state")
    r.add_argument(
        "--checkpoint-every",
        type=types.at_least(1),
        default=0,
        metavar="K",
        help="write a checkpoint into --checkpoint-dir every K steps",
    )
    r.add_argument(
        "--checkpoint-dir",
        metavar="D",
        help="folder or URL (gs://bucket/run/) for the checkpoints; only process 0 writes",
    )
    add(r, "--resume")
    add_init_options(r)
    add(r, "--allow-other-bundle")
    r.add_argument(
        "--lr-schedule",
        action="append",
        metavar="[NAME=]SPEC",
        help="e.g. warmup_cosine:peak=1e-3,warmup=100,total=10000 (NAME defaults to lr; "
        "betas.0=linear:start=0.95,end=0.85,total=1000 schedules Adam's declared beta1)",
    )
    r.add_argument(
        "--set",
        action="append",
        type=types.hyperparameter,
        dest="set_values",
        metavar="NAME=VALUE",
        help="set a declared hyperparameter, e.g. --set lr=3e-4",
    )
    r.add_argument("--seed", type=types.at_least(0), help="RNG seed of the first step")
    add(r, "--devices", "--shard-optimizer-state", "--layout", "--tp-rule", *JOB, "--expect-digest")
    add(r, "--stop-on-nonfinite")
    r.add_argument(
        "--step-timeout",
        type=types.positive_seconds,
        metavar="SECONDS",
        help="end the process (exit 124) if no step finishes for SECONDS, e.g. "
        "--step-timeout 600: a hung multi-process job then stops instead of waiting forever "
        "(off by default)",
    )
    r.add_argument(
        "--check-state",
        action="store_true",
        help="with --stop-on-nonfinite, also check every step's new state on the device (a "
        "NaN input can spoil the state while the loss still looks finite)",
    )
    add(r, "--pack-state")
    r.add_argument(
        "--steps-per-call",
        type=types.steps_per_call,
        default=None,
        metavar="K",
        help="run K steps per dispatch, in a loop compiled around the bundle's step. Same "
        "numbers, bit for bit; checkpoints, --eval-every and stops happen between calls, so "
        "--checkpoint-every and --eval-every must be multiples of K. 'auto' (the default on "
        "an accelerator; 1 on the CPU) times the step and picks 32, 8 or 1 (docs/tpu.md)",
    )
    add(r, "--matmul-precision")
    add_device_options(r)
    r.set_defaults(fn=cmd_run)


def _add_data_options(r: Any) -> None:
    """``stepbundle run``: reading a dataset folder, and evaluating during the run."""
    r.add_argument(
        "--batch-size",
        type=types.at_least(1),
        metavar="B",
        help="global batch size for a dataset folder (default: the bundle's traced batch)",
    )
    r.add_argument(
        "--shuffle-seed",
        type=types.at_least(0),
        default=0,
        metavar="S",
        help="a dataset folder's shuffling seed (default 0; every epoch has its own order), "
        "or a token stream's sampling seed",
    )
    r.add_argument("--no-shuffle", action="store_true", help="read a dataset folder in order")
    r.add_argument(
        "--epochs",
        type=types.at_least(1),
        metavar="E",
        help="stop when a dataset folder has been read E times (default: no limit)",
    )
    r.add_argument(
        "--last-batch",
        choices=("drop", "keep", "pad"),
        default="drop",
        help="a dataset folder's last, short batch: drop it (default), keep it (the bundle "
        "needs a shape bucket of its size) or pad it with copies of its rows",
    )
    r.add_argument(
        "--eval-data",
        metavar="PATH",
        help="an .npz or dataset folder to evaluate with the eval entry every --eval-every "
        "steps: each metric's mean over every row",
    )
    r.add_argument(
        "--eval-every",
        type=types.at_least(1),
        metavar="N",
        help="evaluate --eval-data after every N-th step, e.g. --eval-every 500",
    )
    add(r, "--eval-batch-size")
    r.add_argument(
        "--entry", default="train", help="entry to run (train, or a read-only entry such as eval)"
    )


def _add_eval(sub: Any) -> None:
    """``stepbundle eval``."""
    ev = sub.add_parser(
        "eval",
        help="evaluate a bundle's read-only entry over a whole dataset (no torch needed)",
        description="Each metric's mean over every row of --data, e.g. "
        "stepbundle eval model.stepbundle --data val/ --resume ckpt/step-00001000.safetensors",
    )
    ev.add_argument("bundle", help=_BUNDLE_HELP)
    ev.add_argument("--data", required=True, help="an .npz of stacked batches or a dataset folder")
    ev.add_argument("--entry", default="eval", help="the read-only entry to run (default eval)")
    add(
        ev,
        "--resume",
        help="evaluate this checkpoint's state (a file or URL; a local checkpoint folder: "
        "its latest step-N checkpoint)",
    )
    add_init_options(ev)
    add(ev, "--allow-other-bundle", help="accept a checkpoint of another bundle")
    add(
        ev,
        "--eval-batch-size",
        help="batch size for a dataset folder (default: the entry's traced batch); the "
        "same option as run's",
    )
    # Until 0.3: eval's old spelling, which meant what run calls --eval-batch-size
    # (run's --batch-size is the training batch). Remove the alias in 0.3.
    ev.add_argument(
        "--batch-size",
        type=types.at_least(1),
        dest="eval_batch_size",
        action=types.DeprecatedAlias,
        help=argparse.SUPPRESS,
    )
    ev.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add(ev, "--devices", "--layout", "--tp-rule", help="as for run")
    add(ev, "--expect-digest", "--pack-state", "--matmul-precision")
    add_device_options(ev)
    ev.set_defaults(fn=cmd_eval)


# Exit codes (docs/cli.md lists them too, under "Exit codes": docs/cli.md#exit-codes).
EXIT_OK = 0
EXIT_FAILED = 1  # the bundle, a checkpoint or a step was refused or failed
EXIT_USAGE = 2  # a bad argument or input file, found before anything ran
EXIT_NONFINITE = 3  # --stop-on-nonfinite stopped the run
EXIT_INTERRUPTED = 130  # Ctrl-C before the steps began; during them, 128 + the signal


def _detach_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush cannot raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    # XLA's C++ INFO lines (two "PjRt-IFRT device" lines per process on jax 0.10) are not
    # for a command's user; warnings and errors still print. A value the user set wins.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    args = build_parser().parse_args(argv)
    try:
        code = int(args.fn(args))
        if code == EXIT_PIPE_CLOSED:
            _detach_stdout()
        return code
    except BrokenPipeError:
        # `stepbundle inspect X | head`: the reader is gone. End quietly.
        _detach_stdout()
        return EXIT_PIPE_CLOSED
    except KeyboardInterrupt:
        print("stepbundle: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
