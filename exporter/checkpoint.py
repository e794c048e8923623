"""Load a runtime checkpoint back into the original ``nn.Module`` and optimizer.

The runtime writes safetensors files keyed by PyTorch's names (``state_dict()`` keys,
``optimizer.state.<param name>.<key>``, ``<param name>.grad``) with the step count, seed
and hyperparameters in the metadata. ``load_into`` puts all of it back so training can
continue in PyTorch.

Imports: torch, safetensors.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .errors import ExportError

__all__ = ["load_into"]


def load_into(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Copy a checkpoint written by ``Trainer.save_checkpoint`` into ``model`` and ``optimizer``.

    Tensors keep the device of the model's parameters. Optimizer state is created
    where the optimizer has none yet (a fresh optimizer loads a trained state).
    Declared hyperparameters (``lr``) are written into ``param_groups``.

    Returns the checkpoint's stepbundle metadata (step, seed, hyperparameters, bundle
    digest).

    Raises:
      ExportError: with ``strict``, when names in the checkpoint and the model differ.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(os.fspath(path))
    with safe_open(os.fspath(path), framework="pt") as f:
        meta_raw = (f.metadata() or {}).get("stepbundle")
    meta: dict[str, Any] = json.loads(meta_raw) if meta_raw else {}

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
        for hname, value in (meta.get("hyperparameters") or {}).items():
            parts = hname.split(".")
            if len(parts) == 3 and parts[0] == "param_groups":
                targets = [(optimizer.param_groups[int(parts[1])], parts[2])]
            else:
                targets = [(g, hname) for g in optimizer.param_groups]
            for target, key in targets:
                if isinstance(target.get(key), torch.Tensor):
                    target[key].fill_(float(value))
                else:
                    target[key] = float(value)
    unknown = sorted(set(tensors) - used)
    if strict and (missing or unknown):
        raise ExportError(
            f"The checkpoint {os.fspath(path)!r} does not match the model: missing "
            f"{missing[:5]}, unknown {unknown[:5]}. Load it into the model and optimizer the "
            "bundle was exported from, or pass strict=False."
        )
    return meta
