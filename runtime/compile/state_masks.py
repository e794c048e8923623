"""Attention masks held in state: read as loaded when compiling, held to it afterwards.

A model that keeps its causal mask in a buffer the step never writes (nanoGPT's
``register_buffer("bias", torch.tril(...))``, Hugging Face's eager attention) hands the
mask to the step as a state input. The TPU's fused-attention rewrite computes such a
mask from the value the load placed (the bundle's, or ``init_from``'s) and swaps in a
causal kernel only when that value is the causal triangle (``stablehlo/attention.py``).
The program then assumes the buffer keeps that value: ``unwritten_state`` gives the
rewrite the values it may read, and ``MaskPins`` refuses any later replacement of such a
buffer by another value (``Trainer.load_state_dict``, ``load_checkpoint``, ``--resume``)
with ``FusedMaskError``, instead of running a causal kernel on a mask that is no
longer causal. A checkpoint of the same model holds the same mask and passes.

Imports: numpy, stepbundle.schema, stepbundle.stablehlo, the runtime's errors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepbundle.schema.bindings import (
    BatchInput,
    HyperparameterInput,
    RngSeedInput,
    StateInput,
    StateUpdateOutput,
)
from stepbundle.schema.manifest import Program
from stepbundle.stablehlo.attention import StateValues
from stepbundle.stablehlo.graph import MAX_EVALUATED

from ..errors import BindingError

__all__ = ["FusedMaskError", "MaskPins", "argument_names", "digest_of", "unwritten_state"]


class FusedMaskError(BindingError):
    """New state for a mask buffer that a fused attention kernel was compiled for, with
    another value: the kernel would no longer compute what the step says."""


def digest_of(value: np.ndarray[Any, Any]) -> str:
    """The SHA-256 of an array's dtype, shape and bytes (C order)."""
    h = hashlib.sha256(f"{value.dtype.str}{value.shape}".encode())
    h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def unwritten_state(
    program: Program, initial: Callable[[str], np.ndarray[Any, Any] | None] | None
) -> StateValues:
    """The program's state arguments it never writes, each with a function giving its
    loaded value as the mask evaluation reads it (None when ``initial`` has none, or
    the value is larger than a mask is ever computed)."""
    if initial is None:
        return {}
    written = {o.state for o in program.outputs if isinstance(o, StateUpdateOutput)}
    out: dict[int, tuple[str, Callable[[], Sequence[Any] | None]]] = {}
    for i, inp in enumerate(program.inputs):
        if not isinstance(inp, StateInput) or inp.name in written:
            continue
        if inp.spec.numel > MAX_EVALUATED:
            continue

        def values(name: str = inp.name) -> Sequence[Any] | None:
            value = initial(name)
            if value is None:
                return None
            flat = value.reshape(-1)
            if flat.dtype == np.bool_ or np.issubdtype(flat.dtype, np.integer):
                return list(flat.tolist())
            return list(flat.astype(np.float64).tolist())

        out[i] = (inp.name, values)
    return out


def argument_names(program: Program) -> dict[int, str]:
    """What each of the program's arguments is, in the words the load's reasons use when
    an attention mask reads one (``stablehlo.mask_values``): a batch input, state the
    step writes or state it never writes, a hyperparameter, the random seed."""
    written = {o.state for o in program.outputs if isinstance(o, StateUpdateOutput)}
    out: dict[int, str] = {}
    for i, inp in enumerate(program.inputs):
        if isinstance(inp, BatchInput):
            out[i] = f"the batch input {inp.name!r}"
        elif isinstance(inp, StateInput) and inp.name in written:
            out[i] = f"the state {inp.name!r}, which the step writes"
        elif isinstance(inp, StateInput):
            out[i] = f"the state {inp.name!r}"
        elif isinstance(inp, HyperparameterInput):
            out[i] = f"the hyperparameter {inp.name!r}"
        elif isinstance(inp, RngSeedInput):
            out[i] = "the step's random seed"
    return out


@dataclass(frozen=True)
class MaskPins:
    """The mask buffers fused programs were compiled for: state name -> (the digest of
    the value they were checked against, the programs that assume it)."""

    pins: Mapping[str, tuple[str, tuple[str, ...]]]

    def check(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """Refuse ``arrays`` (new state, by name) when it changes a pinned buffer.

        Raises:
          FusedMaskError: naming the buffer, the programs, and what to do.
        """
        for name, (digest, programs) in self.pins.items():
            if name in arrays and digest_of(np.asarray(arrays[name])) != digest:
                raise FusedMaskError(
                    f"The new value of state {name!r} is not the one the fused attention "
                    f"of {', '.join(programs)} was compiled for: at load this buffer held "
                    "the causal mask, and the program runs a causal attention kernel in "
                    "place of reading it, so a changed mask would be ignored. Nothing was "
                    "replaced. Load the bundle with this state instead (init_from=the "
                    "checkpoint, or --init-from), which checks the mask again, or load it "
                    "with fused_attention=False (--no-fused-attention)."
                )
