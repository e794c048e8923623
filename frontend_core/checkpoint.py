"""Load a runtime checkpoint back into the original ``nn.Module`` and optimizer.

The runtime writes safetensors files keyed by PyTorch's names (``state_dict()`` keys,
``optimizer.state.<param name>.<key>``, ``<param name>.grad``) with the step count, seed
and hyperparameters in the metadata. ``load_into`` puts all of it back so training can
continue in PyTorch, with either front-end installed (no torch_xla needed). The metadata
is parsed and checked by the codec the runtime reads it with
(``stepbundle.schema.checkpoint_meta``), hyperparameter names included: ``betas.0``
restores element 0 of ``betas``.

Imports: torch, safetensors, stepbundle.schema.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from stepbundle.schema.checkpoint_digest import verify_file
from stepbundle.schema.checkpoint_meta import (
    CheckpointMeta,
    HyperparameterPlace,
    parse_checkpoint_metadata,
)

from .errors import ExportError

__all__ = ["load_into"]


def load_into(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
) -> CheckpointMeta:
    """Copy a checkpoint written by ``Trainer.save_checkpoint`` into ``model`` and ``optimizer``.

    Tensors keep the device of the model's parameters. Optimizer state is created
    where the optimizer has none yet (a fresh optimizer loads a trained state).
    Declared hyperparameters are written into ``param_groups``: ``lr`` as the key
    itself, ``betas.0`` as element 0 of the tuple ``betas`` (the other elements kept),
    ``param_groups.<i>.<name>`` in group ``i`` only.

    Returns the checkpoint's stepbundle metadata (step, seed, hyperparameters, bundle
    digest, ...), checked as the runtime checks it.

    Raises:
      CheckpointError: the file has no stepbundle metadata, malformed metadata
        (a ``CheckpointError`` naming a format this version does not read), or bytes that
        do not match its digest (a damaged file).
      ExportError: with ``strict``, when names in the checkpoint and the model (or a
        hyperparameter and the optimizer's ``param_groups``) differ.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(os.fspath(path), framework="pt") as f:
        meta = parse_checkpoint_metadata(path, f.metadata() or {})
    verify_file(path, meta)  # a flipped byte is refused here as the runtime refuses it
    tensors = load_file(os.fspath(path))

    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    used: set[str] = set()
    missing: list[str] = []
    with torch.no_grad():
        for name, p in params.items():
            if name in tensors:
                p.copy_(tensors[name].to(p.device, p.dtype))
                used.add(name)
            else:
                missing.append(name)
            g = tensors.get(f"{name}.grad")
            if g is not None:
                p.grad = g.to(p.device, p.dtype).clone()
                used.add(f"{name}.grad")
        for name, b in buffers.items():
            if b is None:
                continue
            if name in tensors:
                b.copy_(tensors[name].to(b.device, b.dtype))
                used.add(name)
            else:
                missing.append(name)
    if optimizer is not None:
        name_of: dict[int, str] = {}
        for name, p in params.items():
            name_of.setdefault(id(p), name)
        prefix = "optimizer.state."
        for group in optimizer.param_groups:
            for p in group["params"]:
                pname = name_of.get(id(p))
                if pname is None:
                    continue
                keys = [
                    k
                    for k in tensors
                    if k.startswith(f"{prefix}{pname}.")
                    and k[len(prefix) + len(pname) + 1 :].find(".") < 0
                ]
                if not keys:
                    continue
                st = optimizer.state[p]
                for k in keys:
                    key = k[len(prefix) + len(pname) + 1 :]
                    old = st.get(key)
                    device = old.device if isinstance(old, torch.Tensor) else p.device
                    st[key] = tensors[k].to(device).clone()
                    used.add(k)
        for hname, value in meta.hyperparameters.items():
            if not _set_hyperparameter(optimizer, hname, value) and strict:
                raise ExportError(
                    f"The checkpoint {os.fspath(path)!r} holds hyperparameter {hname!r}, "
                    f"which the optimizer ({type(optimizer).__name__}) has no place for in "
                    "its param_groups. Load it into the optimizer the bundle was exported "
                    "from, or pass strict=False."
                )
    unknown = sorted(set(tensors) - used)
    if strict and (missing or unknown):
        raise ExportError(
            f"The checkpoint {os.fspath(path)!r} does not match the model: missing "
            f"{missing[:5]}, unknown {unknown[:5]}. Load it into the model and optimizer the "
            "bundle was exported from, or pass strict=False."
        )
    return meta


def _set_hyperparameter(optimizer: torch.optim.Optimizer, name: str, value: float) -> bool:
    """Write ``value`` where the bundle name ``name`` says; False when there is no such
    place (a group, key or tuple element the optimizer lacks)."""
    place = HyperparameterPlace.parse(name)
    groups = optimizer.param_groups
    if place.group is not None and place.group >= len(groups):
        return False
    targets = groups if place.group is None else [groups[place.group]]
    for group in targets:
        if place.whole_key in group:  # a key that itself ends in .<digits>
            group[place.whole_key] = _assign(group[place.whole_key], value)
            continue
        held = group.get(place.key)
        if place.index is None or not isinstance(held, (tuple, list)):
            return False
        if place.index >= len(held):
            return False
        elems = list(held)
        elems[place.index] = _assign(elems[place.index], value)
        group[place.key] = type(held)(elems)
    return True


def _assign(old: Any, value: float) -> Any:
    """``value`` in place of ``old``: written into a tensor, or as a Python float."""
    if isinstance(old, torch.Tensor):
        with torch.no_grad():
            old.fill_(float(value))
        return old
    return float(value)
