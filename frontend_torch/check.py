"""The torch front-end's reference for the export check of a step that draws random numbers.

This front-end's program draws its random numbers from jax's threefry generator, from the
step's seed (``lowering.py``: random operator number ``k`` of the program draws with
``fold_in(key(seed), k)``), so no ordinary PyTorch step draws the same dropout masks.
``replaying`` is PyTorch on the CPU with those draws replayed: a dispatch mode under the
eager step hands every random operator it runs the value the bundle's program computes
for it, by calling the program's own lowering of that operator (``aten_nn``) with the same
key, and checks each draw against the program's random operators in order (the same
operator, the same shape). Everything else of the step is PyTorch's own, so the check
compares every metric and state tensor as for a step without random numbers, float64
arbiter included (its masks are the same draws).

Where the eager step draws with an operator the program has no lowering for, or its
draws do not line up with the program's (another count, operator or shape), the reference
raises ``CannotReproduce`` and the check is skipped, saying which draw; it never compares
steps whose masks differ.

Imports: torch, jax, numpy, stepbundle.frontend, this package's lowering tables.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from stepbundle.frontend.recipe import Recipe
from stepbundle.frontend.step_check import CPU_EAGER, CannotReproduce, Reference

from .graph import random_nodes
from .lowering import SEED_IMPL
from .registry import LOWERINGS, OpContext, draws_nothing

__all__ = ["Draw", "draws_of", "replaying"]

aten = torch.ops.aten

# The eager operator -> the program's operator it stands for (an in-place draw is traced as
# its functional form, with the same arguments).
_AS_TRACED: dict[Any, Any] = {
    aten.bernoulli_.float: aten.bernoulli.p,
    aten.bernoulli.p: aten.bernoulli.p,
    aten.bernoulli.default: aten.bernoulli.default,
    aten.rand.default: aten.rand.default,
    aten.rand_like.default: aten.rand_like.default,
    aten.uniform_.default: aten.uniform.default,
    aten.uniform.default: aten.uniform.default,
    aten.randn.default: aten.randn.default,
    aten.randn_like.default: aten.randn_like.default,
}


@dataclass(frozen=True)
class Draw:
    """One random operator of the program, in program order.

    Attributes:
      op: the operator (``str`` of its ``OpOverload``: "aten.bernoulli.p").
      shape: the shape it draws.
    """

    op: str
    shape: tuple[int, ...]


def draws_of(gm: fx.GraphModule) -> tuple[Draw, ...]:
    """The program's random operators, in the order its lowering hands out their keys."""
    out = []
    for n in random_nodes(gm):
        val = n.meta.get("val")
        shape = tuple(int(d) for d in val.shape) if isinstance(val, torch.Tensor) else ()
        out.append(Draw(str(n.target), shape))
    return tuple(out)


def _to_jax(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    t = x.detach().cpu()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.view(torch.int16).numpy().view(jnp.bfloat16))
    return jnp.asarray(t.numpy())


def _to_torch(value: Any, like: torch.Tensor) -> torch.Tensor:
    a = np.asarray(value)
    if like.dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy()).to(like.dtype)


class _Replay(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Hands each random operator the eager step runs the program's draw for it."""

    def __init__(self, seed: int, expected: tuple[Draw, ...]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._key = jax.random.key(seed, impl=SEED_IMPL)
        self._expected = expected
        self.done = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded not in func.tags or draws_nothing(func, args, kwargs):
            return out
        traced = _AS_TRACED.get(func)
        k = self.done
        if traced is None:
            raise CannotReproduce(
                f"the eager step draws random numbers with {func}, which this front-end's "
                f"program does not draw the same way"
            )
        want = self._expected[k] if k < len(self._expected) else None
        shape = tuple(int(d) for d in out.shape)
        if want is None or want.op != str(traced) or want.shape != shape:
            had = f"{want.op} of shape {want.shape}" if want else "nothing more"
            raise CannotReproduce(
                f"the eager step's random draw {k} ({traced} of shape {shape}) is not the "
                f"program's ({had})"
            )
        ctx = OpContext(out, lambda: jax.random.fold_in(self._key, k), name=f"draw {k}")
        jargs = [_to_jax(a) for a in args]
        jkwargs = {n: _to_jax(v) for n, v in kwargs.items() if n not in ("dtype", "layout",
                   "device", "pin_memory", "memory_format")}  # fmt: skip
        with jax.enable_x64(True):  # as the program was lowered (lowering.lower)
            value = LOWERINGS[traced](ctx, *jargs, **jkwargs)
            drawn = _to_torch(value, out)
        self.done += 1
        with torch.no_grad():
            out.copy_(drawn.to(out.device))
        return out


def _replay_step(
    expected: tuple[Draw, ...],
    recipe: Recipe,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    seed: int | None,
) -> tuple[Mapping[str, Any], dict[str, torch.Tensor]]:
    if seed is None:  # pragma: no cover - a program with random operators has a seed input
        raise CannotReproduce("the bundle names no seed for its first step")
    with _Replay(seed, expected) as mode:
        out = CPU_EAGER.run(recipe, model, opt, batch, seed)
    if mode.done != len(expected):
        raise CannotReproduce(
            f"the eager step drew {mode.done} times, the program {len(expected)} times"
        )
    return out


def replaying(expected: tuple[Draw, ...]) -> Reference:
    """PyTorch on the CPU with the program's random draws ``expected`` replayed."""
    return Reference(
        "PyTorch eager on the CPU, the bundle's random numbers replayed",
        functools.partial(_replay_step, expected),
        float64=True,
    )
