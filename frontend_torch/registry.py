"""The table from aten operators to their jax implementations, and what each one is given.

``lowering.py`` walks an aten graph and calls, for every node, the function registered
here for its operator (``@lowers(aten.add.Tensor, ...)``). A function gets the node's
arguments with every graph value replaced by a jax array, and an ``OpContext`` that knows
the dtype and shape torch computed for the node's result (``out_dtype``, ``out_shape``)
and hands out the random keys (``key()``).

Why a table of our own rather than torchax's: torchax 0.0.13, the newest release, does not
import with torch 2.14 (its tables name aten overloads torch removed: ``prod.dim_Dimname``,
``cholesky``). The core aten operator set is the stable, documented interface between
torch's tracer and backends; lowering it here ties the front-end to that set only.

Imports: torch, jax, numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

__all__ = [
    "LOWERINGS",
    "draws_nothing",
    "OpContext",
    "compute_dtype",
    "jax_dtype",
    "lowers",
    "select",
    "to_dtype",
]

Lowering = Callable[..., Any]

LOWERINGS: dict[Any, Lowering] = {}
"""aten OpOverload (or a Python callable such as ``operator.getitem``) -> its lowering."""

_JAX_DTYPES: dict[torch.dtype, Any] = {
    torch.float64: jnp.float64,
    torch.float32: jnp.float32,
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.int64: jnp.int64,
    torch.int32: jnp.int32,
    torch.int16: jnp.int16,
    torch.int8: jnp.int8,
    torch.uint64: jnp.uint64,
    torch.uint32: jnp.uint32,
    torch.uint16: jnp.uint16,
    torch.uint8: jnp.uint8,
    torch.bool: jnp.bool_,
}


def jax_dtype(dtype: torch.dtype) -> Any:
    """The jax dtype of a torch dtype (KeyError for dtypes bundles cannot hold)."""
    return _JAX_DTYPES[dtype]


def to_dtype(x: Any, dtype: torch.dtype) -> Any:
    """``x`` (an array or a Python number) as an array of the torch dtype ``dtype``."""
    return jnp.asarray(x).astype(jax_dtype(dtype))


def select(cond: Any, a: Any, b: Any) -> Any:
    """``jnp.where(cond, a, b)`` for arrays of one dtype, written as the ``select`` itself:
    jnp.where lowers to a call of a private function, one per shape, which hides the
    select from the runtime's pattern rewrites (``stablehlo/onehot.py``'s one-hot sums)."""
    shape = jnp.broadcast_shapes(jnp.shape(cond), jnp.shape(a), jnp.shape(b))
    return jax.lax.select(*(jnp.broadcast_to(x, shape) for x in (cond, a, b)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's own kernels compute a ``dtype`` result in ("opmath"): half
    types are computed in float32 and rounded once, at the end of each operator."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def lowers(*ops: Any) -> Callable[[Lowering], Lowering]:
    """Register the decorated function as the lowering of each of ``ops``."""

    def register(fn: Lowering) -> Lowering:
        for op in ops:
            if op in LOWERINGS:  # pragma: no cover - a programming error, caught at import
                raise AssertionError(f"{op} is lowered twice")
            LOWERINGS[op] = fn
        return fn

    return register


@dataclass
class OpContext:
    """What a lowering knows about the node it lowers.

    Attributes:
      out: torch's value for the node as the tracer saw it: a fake tensor, a tuple of
        them (multi-output operators), or a symbolic number.
      key_source: returns the jax random key of the next random operator of the program.
      name: the node's name, for error messages.
    """

    out: Any
    key_source: Callable[[], Any]
    name: str = ""
    args: tuple[Any, ...] = ()
    """The tracer's values of the node's arguments (fake tensors where they are tensors)."""

    @property
    def out_dtype(self) -> torch.dtype:
        dtype: torch.dtype = self.out.dtype
        return dtype

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.out.shape)

    def out_at(self, i: int) -> Any:
        """The fake tensor of output ``i`` of a multi-output operator."""
        return self.out[i]

    def key(self) -> Any:
        """The random key of this operator (each call gives the next one)."""
        return self.key_source()


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def draws_nothing(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """An operator tagged random only for its dropout (the SDPA kernels) with dropout_p 0."""
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    p = (
        args[i]
        if i < len(args)
        else kwargs.get("dropout_p", func._schema.arguments[i].default_value)
    )
    return isinstance(p, (int, float)) and float(p) == 0.0
