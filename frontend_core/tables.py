"""Rows of a program's binding tables that both front-ends build the same way.

Imports: stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Mapping

from stepbundle.schema.manifest import InputKind, StateKind, StateUpdateOutput, TensorSpec

from .errors import ExportError

__all__ = ["STATE_INPUT_KIND", "state_update"]

STATE_INPUT_KIND: Mapping[StateKind, InputKind] = {
    StateKind.PARAMETER: InputKind.PARAMETER,
    StateKind.BUFFER: InputKind.BUFFER,
    StateKind.OPTIMIZER_STATE: InputKind.OPTIMIZER_STATE,
    StateKind.GRADIENT: InputKind.GRADIENT,
}
"""The input kind a program reads a state tensor of each kind as."""


def state_update(
    name: str, spec: TensorSpec, before: TensorSpec | None, donates: int | None, what: str
) -> StateUpdateOutput:
    """The output row of state ``name``'s new value (``spec``), which donates input
    ``donates`` (None: the program does not read the old value).

    Raises:
      ExportError: the step changed the state's dtype or shape (from ``before``).
    """
    if before is not None and before != spec:
        raise ExportError(
            f"The {what} changes the dtype or shape of state {name!r} "
            f"({before} -> {spec}); state must keep its dtype and shape."
        )
    return StateUpdateOutput(name, spec, donates)
