"""The options ``run``, ``eval`` and ``compile`` share, each declared once.

``add(parser, "--devices", "--layout", help=...)`` adds the named options as declared in
``SHARED``; a keyword replaces that keyword of each, as where a command says an option's
help in its own words (``compile``: "as for run: it is part of every entry's key"). The options only one
command has stay in that command's parser (``main.py``, ``prepare.py``).

Imports: the standard library, this package's argument types; ``parallel_options``
imports stepbundle.runtime when called.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Literal

from . import args as types

if TYPE_CHECKING:
    from stepbundle.runtime import ParallelOptions

    from .config import RunConfig

__all__ = [
    "SHARED",
    "add",
    "add_device_options",
    "add_init_options",
    "parallel_options",
]

SHARED: dict[str, dict[str, Any]] = {
    "--resume": {
        "metavar": "CKPT",
        "help": "restore a checkpoint (a file or URL; a local --checkpoint-dir folder: its "
        "latest step-N checkpoint) before the first step",
    },
    "--allow-other-bundle": {
        "action": "store_true",
        "help": "let --resume take a checkpoint written by another bundle (another digest) "
        "whose state table matches, e.g. the same model re-exported",
    },
    "--eval-batch-size": {
        "type": types.at_least(1),
        "metavar": "B",
        "help": "batch size for a dataset folder as --eval-data (default: the eval entry's)",
    },
    "--devices": {
        "type": types.devices,
        "default": 1,
        "metavar": "N|all",
        "help": "run over the first N devices of the job, or all of them (the batch is "
        "split over them; the state as --layout says: replicated by default)",
    },
    "--shard-optimizer-state": {
        "action": "store_true",
        "help": "with several devices, split optimizer state over them (ZeRO-1)",
    },
    "--layout": {
        "default": "dp",
        "metavar": "SPEC",
        "help": "what the devices split: dp (the state replicated), zero1 (optimizer state), "
        "fsdp (parameters, gradients and optimizer state), each optionally +tp[:M] (a "
        "data x model mesh, M devices on the model axis, large matmul weights split over it); "
        "docs/parallel.md",
    },
    "--tp-rule": {
        "type": types.tp_rule,
        "action": "append",
        "metavar": "PATTERN:DIM",
        "help": "with a +tp layout, split the parameters whose names PATTERN matches (an "
        "fnmatch pattern, whole name or dotted suffix) on dimension DIM over the model axis; "
        "repeat it: the first rule that matches a name decides. Given, these rules replace "
        "the default ones for transformer names; 'defaults' puts those in its place "
        "(--tp-rule 'blocks.*.wqkv.weight:0' --tp-rule defaults); docs/parallel.md",
    },
    "--coordinator": {
        "metavar": "HOST:PORT",
        "help": "join a multi-process job whose process 0 listens here (jax.distributed)",
    },
    "--num-processes": {
        "type": types.at_least(1),
        "metavar": "P",
        "help": "processes in the job",
    },
    "--process-id": {
        "type": types.at_least(0),
        "metavar": "I",
        "help": "this process's rank, 0..P-1",
    },
    "--distributed": {
        "action": "store_true",
        "help": "join a multi-process job found from the environment (TPU pods, SLURM, Open MPI)",
    },
    "--expect-digest": {
        "type": types.digest,
        "metavar": "sha256:...",
        "help": "refuse any other bundle (the digest `stepbundle inspect` prints; sha256: optional)",
    },
    "--stop-on-nonfinite": {
        "action": "store_true",
        "help": "stop before a step with a NaN or infinite metric replaces the state, and "
        "write the last good state as a checkpoint into --checkpoint-dir (exit code 3)",
    },
    "--pack-state": {
        "type": types.at_least(0),
        "default": 65536,
        "metavar": "N",
        "help": "hold state tensors of up to N elements in one buffer per dtype (default 65536; "
        "0: off)",
    },
    "--matmul-precision": {
        "choices": ("default", "high", "highest"),
        "default": None,
        "help": "precision of every matmul and convolution (default: the one the bundle "
        "records, the one it was traced at). The CPU computes the same with all three; "
        "on an accelerator 'high' and 'highest' also compute Adam's bias corrections "
        "exactly (docs/tpu.md). Say 'highest' to compare a TPU with a CPU",
    },
    "--device": {"default": "cpu", "help": "cpu, cuda, rocm or tpu (optionally :index)"},
    "--cache-dir": {
        "help": "compilation cache folder or URL, shared by every host that reaches it "
        "(default ~/.cache/stepbundle)",
    },
    "--no-cache": {"action": "store_true", "help": "do not use the compilation cache"},
    "--no-fused-attention": {
        "action": "store_true",
        "help": "keep the bundle's own attention on a TPU, where it is otherwise run as "
        "jax's splash-attention kernels (docs/tpu.md)",
    },
    "--no-bf16-products": {
        "action": "store_true",
        "help": "on one TPU, compile the bundle's float32-out bf16 products as written, where "
        "they are otherwise compiled bf16-out (each product the same bits on a v5e, fewer "
        "relayouts; docs/tpu.md)",
    },
    "--regather-weights": {
        "choices": ("auto", "on", "off"),
        "default": "auto",
        "help": "under --layout fsdp or fsdp+tp: 'auto' (default) compiles the program as "
        "written and, only where it does not fit the device (the compiler refuses it for "
        "memory, or XLA's memory analysis exceeds what the device reports), again with each "
        "split weight gathered again for the backward pass (the same values); 'on' compiles "
        "only that form (skips the refused compile for a model known not to fit as written); "
        "'off' gathers each weight once for all its products (docs/parallel.md)",
    },
    "--no-regather-weights": {
        "dest": "regather_weights",
        "action": "store_const",
        "const": "off",
        "help": "the same as --regather-weights off",
    },
    "--head-barriers": {
        "choices": ("auto", "on", "off"),
        "default": "auto",
        "help": "optimization barriers around the output head's products: 'auto' (default) "
        "compiles a training program on one TPU with them too where XLA fused the residual "
        "stream into the head, and keeps the faster by libtpu's estimate (one more compile "
        "there; docs/tpu.md); 'on' and 'off' decide for every program",
    },
    "--init-from": {
        "type": types.checkpoint_path,
        "metavar": "CKPT",
        "help": "take the initial state from CKPT instead of the bundle: a .safetensors file "
        "(PyTorch's, Hugging Face's or a stepbundle checkpoint), a "
        "model.safetensors.index.json with its shards, or a save_pretrained folder; "
        "state it lacks keeps the bundle's value (a fresh optimizer's zeros)",
    },
    "--init-strict": {
        "action": argparse.BooleanOptionalAction,
        "default": True,
        "help": "with --init-from, refuse a checkpoint holding tensors the bundle does not "
        "name or lacking a parameter (default); --no-init-strict ignores the first and "
        "keeps the bundle's values for the second (dtypes and shapes must still match)",
    },
}
"""Each shared option's argparse keywords, by flag."""

JOB = ("--coordinator", "--num-processes", "--process-id", "--distributed")
"""The options of a multi-process job."""


def add(parser: Any, *flags: str, **overrides: Any) -> None:
    """Add ``flags`` to ``parser`` as ``SHARED`` declares them, each with ``overrides``
    (``help="as for run"``; ``help=None`` for none) in place of its own keywords."""
    for flag in flags:
        parser.add_argument(flag, **{**SHARED[flag], **overrides})


def add_device_options(parser: Any) -> None:
    """Where a bundle runs and where its compiled programs are cached (run, eval, compile)."""
    add(
        parser,
        "--device",
        "--cache-dir",
        "--no-cache",
        "--no-fused-attention",
        "--no-bf16-products",
        "--regather-weights",
        "--no-regather-weights",
        "--head-barriers",
    )


def add_init_options(parser: Any) -> None:
    """Where the initial state comes from (run and eval): ``--init-from``, ``--init-strict``."""
    add(parser, "--init-from", "--init-strict")


def head_barriers(config: RunConfig) -> bool | Literal["auto"]:
    """``CompileOptions.head_barriers`` from ``--head-barriers`` (run, eval, compile)."""
    return {"on": True, "off": False}.get(config.head_barriers, "auto")


def regather_weights(config: RunConfig) -> bool | Literal["auto"]:
    """``CompileOptions.regather_weights`` from ``--regather-weights`` (or
    ``--no-regather-weights``, its ``off``; run, eval, compile)."""
    return {"on": True, "off": False}.get(config.regather_weights, "auto")


def parallel_options(config: RunConfig) -> ParallelOptions:
    """``ParallelOptions`` from ``--devices``, ``--shard-optimizer-state``, ``--layout``
    and ``--tp-rule`` (run, eval, compile).

    Raises:
      LayoutError: a layout that does not parse, or a rule ``ShardRule`` refuses.
    """
    from stepbundle.runtime import ParallelOptions
    from stepbundle.runtime.placement.layout_spec import DEFAULT_TP_RULES, ShardRule

    rules = None
    if config.tp_rule is not None:
        rules = tuple(
            r
            for given in config.tp_rule
            for r in (DEFAULT_TP_RULES if isinstance(given, str) else (ShardRule(*given),))
        )
    return ParallelOptions(
        devices=config.devices,
        shard_optimizer_state=config.shard_optimizer_state,
        layout=config.layout,
        tp_rules=rules,
    )
