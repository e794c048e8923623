"""The rows of a program's binding tables: what each graph input is (``InputBinding``)
and what each output is (``OutputBinding``).

Unions are a kind enum plus one dataclass per case, each carrying its ``kind`` as a
fixed field. Part of the manifest's dataclasses (``manifest.py`` re-exports every name).

Imports: standard library only (and this package's tensor types).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, Union

from .tensors import TensorSpec

__all__ = [
    "BatchInput",
    "ConstantInput",
    "HyperparameterInput",
    "InputBinding",
    "InputKind",
    "MetricOutput",
    "OutputBinding",
    "OutputKind",
    "RngSeedInput",
    "STATE_INPUT_KINDS",
    "StateInput",
    "StateUpdateOutput",
]


class InputKind(str, enum.Enum):
    """Where the value of one program input comes from on every call."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENT = "gradient"
    BATCH = "batch"
    RNG_SEED = "rng_seed"
    HYPERPARAMETER = "hyperparameter"
    CONSTANT = "constant"


STATE_INPUT_KINDS: frozenset[InputKind] = frozenset(
    {InputKind.PARAMETER, InputKind.BUFFER, InputKind.OPTIMIZER_STATE, InputKind.GRADIENT}
)
"""The input kinds that read a ``StateEntry``; ``StateInput.kind`` is one of these."""


@dataclass(frozen=True)
class StateInput:
    """The current value of a state tensor.

    Attributes:
      kind: the state's kind (parameter, buffer, optimizer_state or gradient); equal to
        the kind of the ``StateEntry`` it names.
      name: the ``StateEntry.name`` it reads.
      spec: dtype and shape, equal to the state entry's.
    """

    kind: InputKind
    name: str
    spec: TensorSpec


@dataclass(frozen=True)
class BatchInput:
    """One array of the caller's batch.

    Attributes:
      name: the batch key.
      spec: the dtype and shape this program expects.
    """

    name: str
    spec: TensorSpec
    kind: Literal[InputKind.BATCH] = InputKind.BATCH


@dataclass(frozen=True)
class RngSeedInput:
    """The per-step random seed (torch_xla's device seed), an i64 scalar.

    The runtime derives it from ``Manifest.rng``: step ``k`` receives ``rule^k(seed)``.

    Attributes:
      spec: dtype and shape (``i64[]``).
    """

    spec: TensorSpec
    kind: Literal[InputKind.RNG_SEED] = InputKind.RNG_SEED


@dataclass(frozen=True)
class HyperparameterInput:
    """A named scalar the runtime sets on every call (learning rate, ...).

    Attributes:
      name: a ``Hyperparameter.name`` of the manifest.
      spec: dtype and shape, equal to the hyperparameter's.
    """

    name: str
    spec: TensorSpec
    kind: Literal[InputKind.HYPERPARAMETER] = InputKind.HYPERPARAMETER


@dataclass(frozen=True)
class ConstantInput:
    """A value captured at export time that was proven not to change between steps.

    Attributes:
      name: a readable label (``constant.<n>``), unique within the program.
      spec: dtype and shape.
      section: the tensor section that holds the value.
    """

    name: str
    spec: TensorSpec
    section: str
    kind: Literal[InputKind.CONSTANT] = InputKind.CONSTANT


InputBinding = Union[StateInput, BatchInput, RngSeedInput, HyperparameterInput, ConstantInput]  # noqa: UP007
"""One row of a program's input-binding table; row ``i`` is ``@main``'s argument ``i``."""


class OutputKind(str, enum.Enum):
    """What one program output is."""

    METRIC = "metric"
    STATE_UPDATE = "state_update"


@dataclass(frozen=True)
class MetricOutput:
    """A value handed back to the caller (``loss``, ``accuracy``, eval outputs).

    Attributes:
      name: the key in the dict the step returned.
      spec: dtype and shape.
    """

    name: str
    spec: TensorSpec
    kind: Literal[OutputKind.METRIC] = OutputKind.METRIC


@dataclass(frozen=True)
class StateUpdateOutput:
    """The new value of a state tensor after the step.

    Attributes:
      state: the ``StateEntry.name`` it replaces.
      spec: dtype and shape, equal to the state entry's.
      donates: index of the input that reads the old value of the same state; that
        input's buffer is donated and aliased to this output. ``None`` when the step
        overwrites the state without reading it (nothing to donate).
    """

    state: str
    spec: TensorSpec
    donates: int | None
    kind: Literal[OutputKind.STATE_UPDATE] = OutputKind.STATE_UPDATE


OutputBinding = Union[MetricOutput, StateUpdateOutput]  # noqa: UP007
"""One row of a program's output table; row ``j`` is ``@main``'s result ``j``."""
