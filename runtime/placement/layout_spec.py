"""What a multi-device run splits, and over which mesh axis: the layout spec.

A layout is one spec string (``ParallelOptions(layout=...)``, ``--layout``):

- ``dp``: data parallel. The batch is split over the ``data`` axis, the state replicated.
- ``zero1``: as ``dp``, and each optimizer-state tensor is split over ``data`` too (ZeRO
  stage 1).
- ``fsdp``: fully sharded data parallel (ZeRO stage 3): parameters, their kept gradients
  and their optimizer state are split over ``data``; XLA's SPMD partitioner gathers each
  parameter where the step reads it and reduces its gradient onto the shards (on the
  CPU as an all-reduce; docs/parallel.md).
- ``+tp`` or ``+tp:M`` after any of them (``fsdp+tp``, ``dp+tp:4``): a 2-D mesh, ``data``
  x ``model`` with M devices on the model axis (2 when not given), and the large matmul
  weights split over ``model`` by ``ShardRule`` s (Megatron's column and row split,
  the embedding on its vocabulary); ``tp`` alone is ``dp+tp``.

Every layout runs the bundle's own one-device program: nothing is re-exported, and the
computation is the one-device step up to the order of floating-point sums.

Imports: the standard library and the runtime's errors.
"""

from __future__ import annotations

import enum
import fnmatch
from dataclasses import dataclass

from ..errors import UsageError

__all__ = [
    "DEFAULT_MODEL_AXIS",
    "DEFAULT_TP_RULES",
    "DataSplit",
    "LayoutError",
    "ParallelLayout",
    "ShardRule",
    "parse_layout",
]

DEFAULT_MODEL_AXIS = 2
"""The model axis of ``+tp`` without a size: 2, the smallest split (a v5e-8 then runs
4-way FSDP x 2-way tensor parallel)."""


class LayoutError(UsageError):
    """A layout cannot be applied: a spec string that does not parse, a mesh the devices
    do not fill, or a tensor-parallel rule whose dimension does not divide (the caller's
    choice to change: a ``UsageError``)."""


class DataSplit(str, enum.Enum):
    """What the ``data`` axis splits besides the batch."""

    DP = "dp"  # nothing: the state is replicated
    ZERO1 = "zero1"  # optimizer state
    FSDP = "fsdp"  # parameters, kept gradients and optimizer state


@dataclass(frozen=True)
class ShardRule:
    """Split the parameters a name pattern matches on one dimension over the model axis.

    Attributes:
      pattern: an ``fnmatch`` pattern (``*``, ``?``, ``[...]``) matched against a
        parameter's name, either whole or as a dotted suffix: ``"mlp.c_fc.weight"``
        matches ``"transformer.h.0.mlp.c_fc.weight"``.
      dim: the dimension split over the model axis (negative counts from the end). For a
        ``torch.nn.Linear`` weight (``[out, in]``), 0 is Megatron's column split and 1 its
        row split.

    The parameter's kept gradient and its optimizer-state tensors of the same shape
    (Adam's moments, momentum) are split the same way. The first rule that matches a
    parameter decides it.
    """

    pattern: str
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise LayoutError(
                f"A tensor-parallel rule needs a name pattern (a non-empty str), got "
                f"{self.pattern!r}."
            )
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise LayoutError(
                f"The tensor-parallel rule {self.pattern!r} needs a whole dimension number, "
                f"got {self.dim!r}."
            )

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern) or fnmatch.fnmatchcase(
            name, "*." + self.pattern
        )

    def __str__(self) -> str:
        return f"{self.pattern}:{self.dim}"


def _rules(dim: int, *names: str) -> tuple[ShardRule, ...]:
    return tuple(ShardRule(n, dim) for n in names)


# Megatron's split of a transformer block, in torch.nn.Linear's orientation ([out, in]):
# the projections into attention and into the MLP are split on their outputs (column, dim
# 0; their biases too), the projections back on their inputs (row, dim 1; the bias stays
# whole), the token embedding and the output head on the vocabulary. The names are those
# of nanoGPT and Hugging Face's GPT-2, Llama, BERT, Meta's Llama and timm's ViT blocks
# (attn.qkv, attn.proj, mlp.fc1, mlp.fc2).
DEFAULT_TP_RULES: tuple[ShardRule, ...] = (
    *_rules(
        0,
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "q_proj.bias",
        "k_proj.bias",
        "v_proj.bias",
        "gate_proj.weight",
        "up_proj.weight",
        "attention.self.query.weight",
        "attention.self.key.weight",
        "attention.self.value.weight",
        "attention.self.query.bias",
        "attention.self.key.bias",
        "attention.self.value.bias",
        "intermediate.dense.weight",
        "intermediate.dense.bias",
        "qkv.weight",
        "qkv.bias",
        "in_proj_weight",
        "in_proj_bias",
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "feed_forward.w1.weight",
        "feed_forward.w3.weight",
        "mlp.fc1.weight",
        "mlp.fc1.bias",
    ),
    *_rules(
        1,
        "attn.c_proj.weight",
        "mlp.c_proj.weight",
        "o_proj.weight",
        "down_proj.weight",
        "out_proj.weight",
        "attention.output.dense.weight",
        "output.dense.weight",
        "attention.wo.weight",
        "feed_forward.w2.weight",
        "attn.proj.weight",
        "mlp.fc2.weight",
    ),
    *_rules(
        0,
        "wte.weight",
        "embed_tokens.weight",
        "word_embeddings.weight",
        "tok_embeddings.weight",
        "lm_head.weight",
    ),
)
"""The rules ``+tp`` uses unless given others (``ParallelOptions(tp_rules=...)``). A
parameter a default rule matches but whose dimension does not divide by the model axis
stays whole (``load_info.layout_notes`` names it); a rule the user wrote is held to it."""


@dataclass(frozen=True)
class ParallelLayout:
    """A parsed layout spec (``parse_layout``).

    Attributes:
      data: what the data axis splits besides the batch (``DataSplit``).
      model: devices on the model axis; 1 is no tensor parallelism (a 1-D mesh).
    """

    data: DataSplit = DataSplit.DP
    model: int = 1

    @property
    def spec(self) -> str:
        """The spec string: ``"fsdp+tp:2"``, ``"dp"``."""
        return self.data.value + (f"+tp:{self.model}" if self.model > 1 else "")


def parse_layout(text: str) -> ParallelLayout:
    """``"fsdp+tp:4"`` -> ``ParallelLayout(DataSplit.FSDP, 4)``; raises ``LayoutError``."""
    if not isinstance(text, str):
        raise LayoutError(f"A layout is a spec string such as 'fsdp+tp', got {text!r}.")
    usage = (
        "Use dp, zero1 or fsdp, optionally followed by +tp or +tp:M (M devices on the "
        "model axis), e.g. fsdp+tp:2."
    )
    data: DataSplit | None = None
    model: int | None = None
    for part in text.strip().lower().split("+"):
        part = part.strip()
        name, _, size = part.partition(":")
        if name == "tp":
            if model is not None:
                raise LayoutError(f"The layout {text!r} names tp twice. {usage}")
            if not size:
                model = DEFAULT_MODEL_AXIS
                continue
            try:
                model = int(size)
            except ValueError:
                model = 0
            if model < 1:
                raise LayoutError(
                    f"The layout {text!r} asks for {size!r} devices on the model axis; "
                    f"give a whole number of at least 1. {usage}"
                )
            continue
        try:
            split = DataSplit(name)
        except ValueError:
            raise LayoutError(f"Unknown layout part {part!r} in {text!r}. {usage}") from None
        if size:
            raise LayoutError(f"The layout part {part!r} takes no size. {usage}")
        if data is not None:
            raise LayoutError(
                f"The layout {text!r} names two data splits ({data.value} and {name}). {usage}"
            )
        data = split
    return ParallelLayout(data or DataSplit.DP, model or 1)


def rule_for(name: str, rules: tuple[ShardRule, ...]) -> ShardRule | None:
    """The first rule whose pattern matches parameter ``name``, or None."""
    return next((r for r in rules if r.matches(name)), None)
