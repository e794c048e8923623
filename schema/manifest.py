"""The bundle manifest: frozen, typed dataclasses, and nothing else.

This module is the in-memory contract between the exporter (which fills it in) and the
runtime (which obeys it). The byte encoding lives in ``wire.py``; the rules that tie
fields together live in ``validate.py``.

Unions are a kind enum plus one dataclass per case: an input binding is exactly one of
``StateInput``, ``BatchInput``, ``RngSeedInput``, ``HyperparameterInput`` or
``ConstantInput``, and each carries its ``kind`` as a fixed field. Optional fields are
``None`` when absent; there are no ``-1`` or ``""`` sentinels.

The tensor types live in ``tensors.py`` and the binding-table rows in ``bindings.py``;
this module re-exports them, so ``stepbundle.schema.manifest`` names every type.

Imports: standard library only (and those two modules).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from .bindings import (
    STATE_INPUT_KINDS,
    BatchInput,
    ConstantInput,
    HyperparameterInput,
    InputBinding,
    InputKind,
    MetricOutput,
    OutputBinding,
    OutputKind,
    RngSeedInput,
    StateInput,
    StateUpdateOutput,
)
from .tensors import DType, NamedSpec, TensorSpec

__all__ = [
    "BatchInput",
    "ConstantInput",
    "DType",
    "Entry",
    "Hyperparameter",
    "HyperparameterInput",
    "InputBinding",
    "InputKind",
    "Manifest",
    "MetricOutput",
    "NamedSpec",
    "OutputBinding",
    "OutputKind",
    "Producer",
    "Program",
    "Rng",
    "RngSeedInput",
    "STATE_INPUT_KINDS",
    "Section",
    "SectionKind",
    "StateEntry",
    "StateInput",
    "StateKind",
    "StateUpdateOutput",
    "TensorSpec",
]


class SectionKind(str, enum.Enum):
    """What a section's bytes are.

    A state entry's section says where its initial value comes from: ``tensor`` (the
    value, stored), ``fill`` (one element, repeated over the whole shape: a value given
    by rule, such as a fresh optimizer's zero moments) or ``external`` (no bytes: the
    value must be supplied when the bundle is loaded, from a checkpoint). ``fill`` and
    ``external`` are format 1.1 additions, used only by state entries, and a bundle that
    uses them lists ``version.STATE_INITIALIZERS`` in ``required_features``.
    """

    PROGRAM = "program"  # a StableHLO portable artifact (MLIR bytecode, VHLO)
    TENSOR = "tensor"  # raw little-endian C-order tensor data
    TEXT = "text"  # UTF-8 text for people (for example a program's .mlir), never executed
    FILL = "fill"  # one tensor element (the dtype's item size), the value of every element
    EXTERNAL = "external"  # zero bytes: the value comes from a checkpoint given at load


@dataclass(frozen=True)
class Section:
    """Where one section lies in the file.

    Attributes:
      name: unique name, referenced from the rest of the manifest.
      kind: what the bytes are.
      offset: byte offset from the start of the data area; a multiple of 64.
      length: number of bytes (padding excluded).
      sha256: lowercase hex SHA-256 of the section's ``length`` bytes.
    """

    name: str
    kind: SectionKind
    offset: int
    length: int
    sha256: str


@dataclass(frozen=True)
class Producer:
    """Versions of what wrote the bundle. Informational: readers do not branch on them.

    Attributes:
      stepbundle: version of the exporter package.
      torch: torch version the step was traced with.
      torch_xla: torch_xla version the step was traced with; a bundle written without
        torch_xla says so and names its front-end: ``"none (front-end
        stepbundle.export_torch)"``.
      jax: jax version whose StableHLO tooling serialized the programs.
    """

    stepbundle: str
    torch: str
    torch_xla: str
    jax: str


class StateKind(str, enum.Enum):
    """What a piece of training state is, in PyTorch's terms."""

    PARAMETER = "parameter"  # an nn.Parameter, named by its state_dict key
    BUFFER = "buffer"  # a registered buffer (running_mean, num_batches_tracked, ...)
    OPTIMIZER_STATE = "optimizer_state"  # optimizer.state.<param name>.<key>
    GRADIENT = "gradient"  # <param name>.grad, kept when the user zeroes grads in place


@dataclass(frozen=True)
class StateEntry:
    """One tensor of training state owned by the runtime.

    Attributes:
      name: the name PyTorch users know: a ``state_dict()`` key for parameters and
        buffers, ``optimizer.state.<param name>.<key>`` for optimizer state,
        ``<param name>.grad`` for kept gradients.
      kind: what it is.
      spec: dtype and shape.
      section: the section giving its initial value: a ``tensor`` section (the value),
        a ``fill`` section (one element, repeated) or an ``external`` section (none:
        it must be supplied at load).
      trainable: True for parameters the optimizer updates; False for frozen
        parameters and for everything that is not a parameter.
      aliases: further names of the same tensor (tied weights); they are bound once,
        under ``name``, and written under every name in checkpoints.
    """

    name: str
    kind: StateKind
    spec: TensorSpec
    section: str
    trainable: bool
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Program:
    """One compiled shape of an entry point.

    Attributes:
      section: the program section (StableHLO portable artifact) of ``@main``.
      stablehlo_version: the StableHLO target version the artifact was serialized for;
        any consumer whose StableHLO is at least this version can read it.
      inputs: the input-binding table, one row per argument of ``@main``, in order.
      outputs: the output table, one row per result of ``@main``, in order.
      batch: the full batch signature callers pass (including inputs the program
        does not read, which were pruned); the runtime picks a program by it.
      platforms: PJRT platforms the program can run on (``cpu``, ``cuda``, ``rocm``,
        ``tpu``); empty means any.
      text_section: optional text section with the program as .mlir, for debugging.
    """

    section: str
    stablehlo_version: str
    inputs: tuple[InputBinding, ...]
    outputs: tuple[OutputBinding, ...]
    batch: tuple[NamedSpec, ...]
    platforms: tuple[str, ...] = ()
    text_section: str | None = None


@dataclass(frozen=True)
class Entry:
    """An entry point: ``train``, ``eval`` or another named step.

    Attributes:
      programs: its shape buckets, at least one; batch signatures differ pairwise.
      updates_state: True when calling it advances the training state (train);
        False for read-only entries (eval), which then donate nothing.
      eval_modules: the modules that were in eval mode (``training`` False) while the
        entry was traced, by their ``named_modules()`` names in model order, the model
        itself being ``""`` as PyTorch names it (1.1). A train entry lists the modules the
        user left in eval mode (frozen BatchNorm, dropout off): their layers ran as in
        inference. Empty when every module trained (or the producer did not record it).
    """

    programs: tuple[Program, ...]
    updates_state: bool
    eval_modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hyperparameter:
    """A named scalar input with its value at export time.

    Attributes:
      name: the name users set it by (``lr``, or ``param_groups.<i>.<key>``).
      spec: dtype and shape (a scalar).
      value: the value at export time, which the runtime starts from.
    """

    name: str
    spec: TensorSpec
    value: float


@dataclass(frozen=True)
class Rng:
    """The random-number state of the training process.

    Attributes:
      seed: the seed the first step receives, an integer in [0, 2**64).
      rule: how the seed advances between steps. ``torch_xla.mark_step``:
        ``next = (1012031 + seed * 7012063) mod 2**64``, the rule torch_xla applies at
        every ``mark_step``; the seed is passed to the program as the i64 with the same
        64 bits. ``rng.advance_seed`` applies it.
      restored_after_draws: informational (1.2): for each time the step restored
        torch_xla's RNG state mid-step (``torch_xla.utils.checkpoint`` recomputing a
        segment), how many draws after the step's seed the restored seed was: the
        programs derive that seed from their one seed input themselves,
        ``rng.draw_seed(seed, K)``. Default ``()``.
      step_after_draws: (1.2, required feature ``rng_restored_draws`` when not 0) the
        draws ``N`` whose seed torch_xla's last restore left behind: the next step's
        seed is ``rule(draw_seed(seed, N))`` instead of ``rule(seed)``. Default 0.
    """

    seed: int
    rule: Literal["torch_xla.mark_step"] = "torch_xla.mark_step"
    restored_after_draws: tuple[int, ...] = ()
    step_after_draws: int = 0


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to know about a bundle, apart from the section bytes.

    Attributes:
      producer: versions of what wrote it.
      entries: entry points by name; ``train`` is always present in exported bundles.
      state: the state table, in a stable order (parameters, buffers, optimizer state,
        gradients, each in PyTorch's order).
      hyperparameters: named scalar inputs and their initial values.
      rng: the random-number state, or ``None`` when no program reads a seed.
      sections: every section of the file, in file order.
      required_features: features a reader must understand to use this bundle
        correctly; a reader refuses a bundle naming a feature it does not know.
      metadata: free text for the people and tools that handle the bundle
        (``Recipe(metadata=...)``): by convention ``name``, ``description`` and
        ``source_commit``, plus any labels. Informational: readers never branch on it.
        (Format 1.1.)
      numerics: how the programs compute ops whose numerics differ between
        implementations (format 1.1). ``"pytorch"``: as PyTorch's kernels do, in plain
        StableHLO (training BatchNorm's variance from centred values, not XLA's
        E[x^2] - E[x]^2); ``"torch_xla"``: exactly as torch_xla lowered the step, to
        ops each XLA release expands its own way. ``None``: not recorded (1.0 bundles,
        1.1 bundles written before the field). Informational: the programs are plain
        StableHLO either way, and readers never branch on it. A reader refuses any value
        but ``schema.version.NUMERICS`` in a bundle of its own version or older, and
        accepts any non-empty string from a newer minor.
      matmul_precision: the matmul precision the step was traced under, one of
        ``schema.version.MATMUL_PRECISIONS`` (format 1.2; ``"default"`` when absent). The
        runtime sets it on every dot_general and convolution at load unless told otherwise.
    """

    producer: Producer
    entries: Mapping[str, Entry]
    state: tuple[StateEntry, ...]
    hyperparameters: tuple[Hyperparameter, ...]
    rng: Rng | None
    sections: tuple[Section, ...]
    required_features: tuple[str, ...] = field(default=())
    metadata: Mapping[str, str] = field(default_factory=dict)
    numerics: str | None = None
    matmul_precision: str = "default"

    def state_entry(self, name: str) -> StateEntry:
        """The state entry called ``name`` (its primary name). KeyError if absent."""
        for s in self.state:
            if s.name == name:
                return s
        raise KeyError(name)

    def section(self, name: str) -> Section:
        """The section called ``name``. KeyError if absent."""
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(name)
