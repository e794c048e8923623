"""Declared hyperparameters: ``param_groups`` settings that become named scalar inputs.

``Recipe(hyperparameters=("lr", "betas.0"))`` replaces each named setting, in every
param group, by a device tensor that the traced step reads, so that it becomes a graph
input the runtime sets on every step. A plain key (``"lr"``) names the setting itself;
``"<key>.<i>"`` names element ``i`` of a tuple setting (``"betas.0"``: Adam's beta1,
which OneCycleLR and CyclicLR cycle). With one param group the bundle's name is the
key; with several, ``param_groups.<i>.<key>``.

Imports: torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .dtypes import HYPERPARAMETER_DTYPE
from .errors import ExportError

__all__ = ["Declared", "DeclaredValue", "declare_hyperparameters", "declared_values", "place_of"]


@dataclass
class Declared:
    """The tensors put into ``param_groups``, by bundle name, and where each one lives:
    (group index, key, tuple index or None)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    places: dict[str, tuple[int, str, int | None]] = field(default_factory=dict)

    def replaced(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """The names whose tensor ``param_groups`` no longer holds (code in the step,
        such as a scheduler, put another value there)."""
        out = []
        for name, (i, key, index) in self.places.items():
            held = optimizer.param_groups[i].get(key)
            if index is not None:
                held = (
                    held[index] if isinstance(held, (tuple, list)) and len(held) > index else None
                )
            if held is not self.tensors[name]:
                out.append(name)
        return out


def place_of(
    optimizer: torch.optim.Optimizer, key: str, group: dict[str, Any], i: int
) -> tuple[str, int | None]:
    """Where a declared hyperparameter lives in param group ``i``: ``"lr"`` is the key
    itself, ``"betas.0"`` the first element of the tuple ``betas``.

    Raises:
      ExportError: no such key or element, or Adam's beta2 (which torch reads as a
        Python number).
    """
    if isinstance(key, str) and key in group and key != "params":
        return key, None
    base, index = _element(key, group, i)
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    if adam and base == "betas" and index == 1:
        raise ExportError(
            f"Hyperparameter {key!r} (beta2) cannot be declared for "
            f"{type(optimizer).__name__}: torch's update reads beta2 as a Python number "
            "(exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2) in "
            "torch/optim/adam.py), which a bundle would freeze. Declare 'betas.0' (beta1, "
            "which OneCycleLR and CyclicLR cycle) and keep beta2 fixed."
        )
    return base, index


def _element(key: str, group: dict[str, Any], i: int) -> tuple[str, int]:
    base, _, index = key.rpartition(".") if isinstance(key, str) else ("", "", "")
    elems = group.get(base)
    if base and index.isdigit() and isinstance(elems, (tuple, list)):
        if int(index) < len(elems):
            return base, int(index)
        raise ExportError(
            f"Hyperparameter {key!r}: param_groups[{i}][{base!r}] is {elems!r}, which has "
            f"{len(elems)} elements (declare "
            f"{', '.join(f'{base}.{j}' for j in range(len(elems)))})."
        )
    raise ExportError(
        f"Hyperparameter {key!r} is not a key of the optimizer's "
        f"param_groups[{i}] (keys: {sorted(k for k in group if k != 'params')}). "
        "Declare only param_groups keys, for example hyperparameters=('lr',), or an "
        "element of a tuple one, for example 'betas.0'."
    )


@dataclass(frozen=True)
class DeclaredValue:
    """One declared hyperparameter in one param group, before anything is swapped in.

    Attributes:
      name: its bundle name (the key; ``param_groups.<i>.<key>`` with several groups).
      group: the param group's index.
      key: the ``param_groups`` key holding it (``"betas"`` for ``"betas.0"``).
      index: the tuple element (0 for ``"betas.0"``), or None for the key itself.
      value: its current value.
    """

    name: str
    group: int
    key: str
    index: int | None
    value: float


def declared_values(optimizer: torch.optim.Optimizer, keys: Sequence[str]) -> list[DeclaredValue]:
    """Each declared key in each param group, with its current value (both front-ends).

    Raises:
      ExportError: a key names no setting (``place_of``), or a setting that is not a
        real scalar (a tuple's elements are declared one by one).
    """
    groups = optimizer.param_groups
    out = []
    for key in keys:
        for i, group in enumerate(groups):
            base, index = place_of(optimizer, key, group, i)
            value = group[base] if index is None else group[base][index]
            if isinstance(value, torch.Tensor):
                value = float(value.detach().cpu())
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                elements = (
                    ", ".join(repr(f"{key}.{j}") for j in range(len(value)))
                    if isinstance(value, (tuple, list))
                    else ""
                )
                raise ExportError(
                    f"Hyperparameter {key!r} of param_groups[{i}] is {value!r}; only real "
                    "scalars can be exported as hyperparameters"
                    + (f". Declare a tuple's elements one by one: {elements}." if elements else ".")
                )
            name = key if len(groups) == 1 else f"param_groups.{i}.{key}"
            out.append(DeclaredValue(name, i, base, index, float(value)))
    return out


def declare_hyperparameters(
    optimizer: torch.optim.Optimizer, keys: Sequence[str], device: torch.device, family: str
) -> Declared:
    """Put a device tensor in ``param_groups`` for each declared key, in every group.

    ``family`` is the workspace's optimizer family (``"adam"``, ``"sgd"``, ...).
    """
    out = Declared()
    for d in declared_values(optimizer, keys):
        group = optimizer.param_groups[d.group]
        # Each declared value gets a device buffer of its own: torch_xla hands out
        # one shared buffer for equal scalars uploaded from the host, so two groups
        # with the same lr would be one graph input, bound to one name.
        t = torch.tensor(d.value, dtype=HYPERPARAMETER_DTYPE).to(device).clone()
        if family == "sgd" and d.key == "lr":
            # torch's SGD turns a plain tensor lr into a Python number (alpha=-lr),
            # which reads it on the host; a tensor that requires grad takes its
            # addcmul path, which keeps lr in the graph.
            t.requires_grad_(True)
        if d.index is None:
            group[d.key] = t
        else:
            # A tuple setting (Adam's betas): the element becomes the tensor, the
            # others stay numbers, as torch.optim takes either per element.
            elems = list(group[d.key])
            elems[d.index] = t
            group[d.key] = type(group[d.key])(elems)
        out.tensors[d.name] = t
        out.places[d.name] = (d.group, d.key, d.index)
    return out
