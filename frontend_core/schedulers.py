"""What a learning-rate scheduler changed in the optimizer before the export.

Creating a torch scheduler edits ``param_groups`` at once: ``LinearLR(start_factor=0.25)``
multiplies lr by 0.25, ``OneCycleLR`` sets lr to ``max_lr / div_factor`` and, with
``cycle_momentum``, Adam's beta1 to ``max_momentum``. An export bakes every setting
that is not a declared hyperparameter, so such a value would be frozen in the bundle
without a word. torch's schedulers leave their marks in the groups (``initial_lr`` for
every one; ``max_lr``, ``max_momentum`` for the cyclic ones), which is how these notes
find them.

Imports: torch (for types only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["scheduler_notes"]

# Keys only the cyclic schedulers (OneCycleLR, CyclicLR) write: they own lr outright
# (``initial_lr`` is then their own starting point, not the user's lr).
_CYCLIC_KEYS = ("max_lr", "max_momentum")


def _fmt(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    if isinstance(value, float):
        return f"{value:.6g}"
    return repr(value)


def _group_notes(group: dict[str, Any], declared: set[str]) -> list[tuple[str, str, str]]:
    """(setting, value shown, key to declare) for each value a scheduler set and the
    user did not declare."""
    if "initial_lr" not in group and not any(k in group for k in _CYCLIC_KEYS):
        return []
    cyclic = any(k in group for k in _CYCLIC_KEYS)
    out = []
    lr = group.get("lr")
    if (
        "lr" not in declared
        and isinstance(lr, float)
        and (cyclic or lr != group.get("initial_lr", lr))
    ):
        out.append(("lr", _fmt(lr), "lr"))
    if "max_momentum" in group:
        # cycle_momentum: beta1 for the Adam family, momentum for the others.
        if isinstance(group.get("betas"), (tuple, list)) and "betas.0" not in declared:
            out.append(("betas", _fmt(group["betas"]), "betas.0"))
        elif "momentum" in group and "betas" not in group and "momentum" not in declared:
            out.append(("momentum", _fmt(group["momentum"]), "momentum"))
    return out


def scheduler_notes(optimizer: torch.optim.Optimizer, hyperparameters: Sequence[str]) -> list[str]:
    """One line per param group (one for all when they agree) naming the values a
    scheduler set at its construction that the bundle will keep fixed."""
    declared = set(hyperparameters)
    per_group = [_group_notes(g, declared) for g in optimizer.param_groups]
    if not any(per_group):
        return []
    same = all(n == per_group[0] for n in per_group)
    notes = []
    for i, found in enumerate(per_group[:1] if same else per_group):
        if not found:
            continue
        where = "" if same else f"param_groups[{i}]: "
        values = " and ".join(f"{k} {v}" for k, v, _ in found)
        keys = repr(tuple(d for _, _, d in found))
        verb = "was" if len(found) == 1 else "were"
        them = "it" if len(found) == 1 else "them"
        notes.append(
            f"{where}{values} {verb} set by a scheduler; declare {them} to schedule {them} "
            f"at run time (Recipe(hyperparameters={keys}), then trainer.set_schedule or "
            "stepbundle run --lr-schedule NAME=SPEC). As exported, the bundle keeps "
            f"{them} fixed at {'this value' if len(found) == 1 else 'these values'}."
        )
    return notes
