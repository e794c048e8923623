"""Plans: how the trainer feeds one shape bucket of an entry, precomputed at load.

A plan is one of two cases, told apart by ``kind``:

- ``CompiledPlan``: the bucket's program is compiled; the plan says where each argument
  comes from (state buffer, batch input, seed, hyperparameter, constant) and where each
  result goes (metric, state update), so a step assembles its arguments from slots.
- ``RefusedPlan``: the bucket cannot run where the trainer runs (a batch that does not
  split over the data-parallel devices); its program was not compiled, and a batch of
  its shape is refused with the plan's message before anything is dispatched.

Both carry the bucket's batch signature, so a batch is matched against every bucket of
an entry the same way.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from stepbundle.schema.manifest import (
    BatchInput,
    ConstantInput,
    HyperparameterInput,
    MetricOutput,
    Program,
    RngSeedInput,
    StateInput,
    StateUpdateOutput,
)

from .. import _compat
from ..compile.program import CompiledProgram
from ..dtypes import to_numpy
from ..placement.sharding import Placement

__all__ = [
    "BatchSignature",
    "CompiledPlan",
    "Plan",
    "PlanKind",
    "RefusedPlan",
    "batch_text",
    "build_plan",
    "refused_plan",
]

BatchSignature = Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]]
"""Batch input name -> (shape, numpy dtype), in the program's batch order."""


class PlanKind(enum.Enum):
    COMPILED = "compiled"
    REFUSED = "refused"


@dataclass(frozen=True, eq=False)
class CompiledPlan:
    """A shape bucket whose program is compiled, and the slots that feed it.

    Attributes:
      entry: the entry's name ("train", "eval").
      index: the bucket's position in the entry's programs.
      compiled: the loaded executable and the program it was compiled from.
      template: one argument per program input, constants filled in, the rest None;
        every step copies it and fills the slots below (it is never changed).
      state_slots: (argument position, state buffer index) per state input.
      batch_slots: (argument position, batch input name) per batch input.
      seed_slot: the argument position of the RNG seed; None when the program uses none.
      hyper_slots: (argument position, hyperparameter name) per hyperparameter input.
      metric_slots: (result position, metric name) per metric output.
      update_slots: (result position, state buffer index) per state update.
      batch_sig: the batch this bucket takes.
      loss_slot: the result position of the metric called "loss"; None without one.
      signature_text: the batch signature as users see it in errors.
      dispatch: runs the executable on an argument list and returns its results.
      kind: always ``PlanKind.COMPILED``.
    """

    entry: str
    index: int
    compiled: CompiledProgram
    template: list[Any]
    state_slots: tuple[tuple[int, int], ...]
    batch_slots: tuple[tuple[int, str], ...]
    seed_slot: int | None
    hyper_slots: tuple[tuple[int, str], ...]
    metric_slots: tuple[tuple[int, str], ...]
    update_slots: tuple[tuple[int, int], ...]
    batch_sig: BatchSignature
    loss_slot: int | None
    signature_text: str
    dispatch: _compat.ExecutableCall
    kind: Literal[PlanKind.COMPILED] = field(default=PlanKind.COMPILED, init=False)

    @property
    def executable(self) -> Any:
        return self.compiled.executable

    def arguments(self, state: Sequence[Any], batch: Mapping[str, Any]) -> list[Any]:
        """A fresh argument list: the template with the state and batch slots filled
        (the seed and hyperparameter slots are the caller's)."""
        args = self.template.copy()
        for pos, si in self.state_slots:
            args[pos] = state[si]
        for pos, name in self.batch_slots:
            args[pos] = batch[name]
        return args


@dataclass(frozen=True, eq=False)
class RefusedPlan:
    """A shape bucket that cannot run where the trainer runs; its program is not compiled.

    Attributes:
      entry: the entry's name.
      index: the bucket's position in the entry's programs.
      batch_sig: the batch this bucket would take (a batch of this shape is refused).
      signature_text: the batch signature as users see it in errors.
      refusal: the whole-sentence message a batch of this bucket is refused with.
      kind: always ``PlanKind.REFUSED``.
    """

    entry: str
    index: int
    batch_sig: BatchSignature
    signature_text: str
    refusal: str
    kind: Literal[PlanKind.REFUSED] = field(default=PlanKind.REFUSED, init=False)


Plan = CompiledPlan | RefusedPlan


def batch_text(program: Program) -> str:
    """The shape bucket as users see it in errors: ``{x: f32[8,5], y: f32[8,3]}``."""
    return "{" + ", ".join(f"{b.name}: {b.spec}" for b in program.batch) + "}"


def _batch_signature(program: Program) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    return {b.name: (tuple(b.spec.shape), to_numpy(b.spec.dtype)) for b in program.batch}


def refused_plan(entry: str, index: int, program: Program, refusal: str) -> RefusedPlan:
    """A plan for a shape bucket that cannot run here: batches of its shape are refused
    with ``refusal`` before anything is dispatched. Its program is not compiled."""
    return RefusedPlan(
        entry=entry,
        index=index,
        batch_sig=_batch_signature(program),
        signature_text=batch_text(program),
        refusal=refusal,
    )


def build_plan(
    entry: str,
    index: int,
    compiled: CompiledProgram,
    state_index: Mapping[str, int],
    constants: Mapping[str, Any],
    placement: Placement,
) -> CompiledPlan:
    """Precompute where each argument comes from and where each result goes."""
    program = compiled.program
    template: list[Any] = [None] * len(program.inputs)
    state_slots: list[tuple[int, int]] = []
    batch_slots: list[tuple[int, str]] = []
    hyper_slots: list[tuple[int, str]] = []
    seed_slot = None
    for i, inp in enumerate(program.inputs):
        if isinstance(inp, StateInput):
            state_slots.append((i, state_index[inp.name]))
        elif isinstance(inp, BatchInput):
            batch_slots.append((i, inp.name))
        elif isinstance(inp, RngSeedInput):
            seed_slot = i
        elif isinstance(inp, HyperparameterInput):
            hyper_slots.append((i, inp.name))
        elif isinstance(inp, ConstantInput):
            template[i] = constants[inp.section]
    metric_slots: list[tuple[int, str]] = []
    update_slots: list[tuple[int, int]] = []
    loss_slot = None
    for j, out in enumerate(program.outputs):
        if isinstance(out, MetricOutput):
            metric_slots.append((j, out.name))
            if out.name == "loss":
                loss_slot = j
        elif isinstance(out, StateUpdateOutput):
            update_slots.append((j, state_index[out.state]))
    return CompiledPlan(
        entry=entry,
        index=index,
        compiled=compiled,
        template=template,
        state_slots=tuple(state_slots),
        batch_slots=tuple(batch_slots),
        seed_slot=seed_slot,
        hyper_slots=tuple(hyper_slots),
        metric_slots=tuple(metric_slots),
        update_slots=tuple(update_slots),
        batch_sig=_batch_signature(program),
        loss_slot=loss_slot,
        signature_text=batch_text(program),
        dispatch=_compat.ExecutableCall(
            compiled.executable,
            [(o.spec.shape, to_numpy(o.spec.dtype)) for o in program.outputs],
            placement.output_shardings(program),
            partitioned=placement.partitioned,
        ),
    )
