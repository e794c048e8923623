"""Reference runs for the torch front-end's tests: PyTorch eagerly, in float32 and float64.

Three references per recipe, all plain PyTorch on the CPU from the recipe's own initial
state and batches (``tests/support.py`` trains):

- ``eager32``: the recipe as a user runs it on the CPU (Adam's ``capturable`` off, which
  torch requires there; the bias correction is then Python float64 arithmetic);
- ``same32``: the same float32 arithmetic the recipe asks for (``capturable=True`` keeps
  Adam's step count a float32 tensor, as on a GPU or under ``torch.compile``), run by
  PyTorch's CPU kernels: ``torch.compiler.is_compiling`` answers True, which is what
  lets ``torch.optim`` run its capturable path on the CPU;
- ``exact64``: the recipe in float64 (default dtype float64, so Adam's step count is
  float64 too): the ground truth.

Imports torch; nothing of the front-end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import numpy as np
import torch
from equiv_harness import normwise_rel, on_cpu
from support import Run, train_eager_cpu


def eager32(recipe_fn: Callable[[], Any], batches: Sequence[Any], steps: int, **kw: Any) -> Run:
    return train_eager_cpu(on_cpu(recipe_fn), batches, steps, **kw)


def same32(recipe_fn: Callable[[], Any], batches: Sequence[Any], steps: int, **kw: Any) -> Run:
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        return train_eager_cpu(recipe_fn, batches, steps, **kw)


def exact64(recipe_fn: Callable[[], Any], batches: Sequence[Any], steps: int, **kw: Any) -> Run:
    def make() -> Any:
        r = on_cpu(recipe_fn)()
        r.model.double()
        return r

    wide = [
        {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in b.items()}
        for b in batches
    ]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return train_eager_cpu(make, wide, steps, **kw)
    finally:
        torch.set_default_dtype(before)


def tied_aliases(recipe_fn: Callable[[], Any]) -> dict[str, str]:
    """Second names of tied parameters -> their first name (as ``state_dict`` lists them)."""
    r = recipe_fn()
    first: dict[int, str] = {}
    out = {}
    for name, p in r.model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def f64_failures(
    got: Run, ref32: Run, ref64: Run, *, factor: float = 2.0, floor: float = 1e-6
) -> tuple[list[str], float, float]:
    """Every floating state tensor at most ``factor`` times as far from float64 as PyTorch
    float32 is (normwise), or within ``floor`` of it.

    Returns the failures, and the worst distances to float64 of ``got`` and of ``ref32``.
    """
    bad, worst_got, worst_ref = [], 0.0, 0.0
    for name, exact in ref64.state.items():
        if name not in got.state or exact.dtype.kind != "f":
            continue
        d_got = normwise_rel(got.state[name], exact)
        d_ref = normwise_rel(ref32.state[name], exact)
        worst_got, worst_ref = max(worst_got, d_got), max(worst_ref, d_ref)
        if not d_got <= max(factor * d_ref, floor):
            bad.append(f"{name}: {d_got:.3g} from float64, PyTorch float32 {d_ref:.3g}")
    return bad, worst_got, worst_ref
