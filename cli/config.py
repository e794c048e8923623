"""One frozen record of what a ``run``, ``eval`` or ``compile`` command line asks for.

``main`` parses the command line with argparse; ``RunConfig.from_args`` turns the
namespace into a ``RunConfig`` once, and the command passes that record by value: a step
that resolves something before the load (``--resume DIR``'s latest checkpoint, a
``sha256:`` bundle's file in the store, a sink's local path) returns a new record
(``dataclasses.replace``) rather than writing into the arguments. Options a command does
not have keep their defaults here, which are what the command means without them.

Imports: the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = ["RunConfig"]

# Namespace entries that are argparse's plumbing, not options.
_PLUMBING = frozenset({"fn", "command"})


@dataclass(frozen=True)
class RunConfig:
    """A ``stepbundle run``, ``eval`` or ``compile`` command line (``docs/cli.md`` says
    what each option does; the field of ``--some-option`` is ``some_option``).

    Attributes:
      command: "run", "eval" or "compile".
      bundle: the bundle as given: a path, a URL or ``sha256:<digest>``.
      entry: the entry a run or an evaluation runs.
      entries: the entries ``compile`` compiles (``--entry``, repeated); None: all.
      set_values: ``--set NAME=VALUE``, in order.
      lr_schedule: ``--lr-schedule [NAME=]SPEC``, in order.
      pack_state: ``--pack-state N`` (True: the runtime's default).
      steps_per_call: an int, "auto", or None (run's default: auto on an accelerator,
        1 on the CPU).
      bundle_file, bundle_digest: a ``sha256:`` bundle's verified file in the store and
        its digest, found once before the load (``outputs.check_outputs``); None before,
        and for any other bundle.
      The other fields are the options of the same names.
    """

    command: str
    bundle: str
    device: str = "cpu"
    cache_dir: str | None = None
    no_cache: bool = False
    no_fused_attention: bool = False
    no_bf16_products: bool = False
    regather_weights: str = "auto"
    head_barriers: str = "auto"
    entry: str = "train"
    entries: tuple[str, ...] | None = None
    data: str = ""
    steps: int | None = None
    until_step: int | None = None
    batch_size: int | None = None
    shuffle_seed: int = 0
    no_shuffle: bool = False
    epochs: int | None = None
    last_batch: str = "drop"
    eval_data: str | None = None
    eval_every: int | None = None
    eval_batch_size: int | None = None
    json: bool = False
    log_every: int | None = None
    metrics_file: str | None = None
    tensorboard: str | None = None
    save_state: str | None = None
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    resume: str | None = None
    init_from: str | None = None
    init_strict: bool = True
    allow_other_bundle: bool = False
    lr_schedule: tuple[str, ...] = ()
    set_values: tuple[tuple[str, float], ...] = ()
    seed: int | None = None
    devices: int | str = 1
    shard_optimizer_state: bool = False
    layout: str = "dp"
    tp_rule: tuple[tuple[str, int] | str, ...] | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    distributed: bool = False
    expect_digest: str | None = None
    stop_on_nonfinite: bool = False
    step_timeout: float | None = None
    check_state: bool = False
    pack_state: bool | int = True
    steps_per_call: int | Literal["auto"] | None = None
    matmul_precision: str | None = None
    bundle_file: str | None = None
    bundle_digest: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        """The record of a parsed ``run``, ``eval`` or ``compile`` command line.

        Raises:
          TypeError: the parser has an option this record has no field for (a new
            option must be added here, or it would be dropped without a word).
        """
        given = {k: v for k, v in vars(args).items() if k not in _PLUMBING}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise TypeError(
                f"RunConfig has no field for {', '.join(unknown)}: add one to cli/config.py."
            )
        for key in ("entries", "lr_schedule", "set_values", "tp_rule"):
            if isinstance(given.get(key), list):
                given[key] = tuple(given[key])
            elif key not in ("entries", "tp_rule") and given.get(key) is None:
                given.pop(key, None)
        return cls(command=args.command, **given)
