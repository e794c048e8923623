"""What a bundle holds for each state entry's initial value: the value, a rule, or nothing.

With ``Recipe(include_state=True)`` (the default) every state tensor is stored as a
``tensor`` section. A bundle without weights (``include_state=False``, ``stepbundle
export --no-state``) stores no weights (format 1.1, ``state_initializers``):

- parameters and persistent buffers (what ``state_dict()`` and therefore every PyTorch or
  Hugging Face checkpoint holds) are ``external``: a run takes them from a checkpoint
  (``StateOptions(init_from=...)``, ``stepbundle run --init-from``);
- every other tensor whose elements are all the same bits is a ``fill`` of that one
  element: the state a fresh optimizer starts from, which the exporter materializes
  (``workspace.py``): Adam/AdamW ``step``, ``exp_avg``, ``exp_avg_sq``,
  ``max_exp_avg_sq``, SGD's ``momentum_buffer``, the syncfree optimizers' ``step`` and
  buffers (zeros, including syncfree Adam's empty ``max_exp_avg_sq``), and the zero
  gradients of a step that keeps them. The fill is taken from the value itself, so it is
  exactly what the bundle would otherwise have stored;
- optimizer state and gradients with differing elements (an optimizer that had stepped
  before the export) are ``external`` too: only a checkpoint the runtime wrote holds them;
- non-persistent buffers with differing elements (``inv_freq`` of rotary embeddings)
  are stored: they are part of the model's code, and no checkpoint holds them.

Imports: torch, stepbundle.schema (no torch_xla: the torch front-end shares it).
"""

from __future__ import annotations

from typing import Protocol

import torch

from stepbundle.schema.manifest import SectionKind, StateKind

from .dtypes import tensor_bytes
from .errors import MetaTensorError


class StateRow(Protocol):
    """What ``initial_section`` reads of a state tensor: both front-ends' state records
    (``workspace.StateTensor``, ``export_torch``'s ``Slot``) have these."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> StateKind: ...
    @property
    def aliases(self) -> tuple[str, ...]: ...


__all__ = ["initial_section", "non_persistent_buffers"]

# Integer dtypes of each item size: elements are compared as bits (-0.0 is not 0.0, and
# a NaN fill equals itself).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def non_persistent_buffers(model: torch.nn.Module) -> set[str]:
    """The names of every buffer registered with ``persistent=False`` (not in state_dict)."""
    out: set[str] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for leaf in module._non_persistent_buffers_set:
            out.add(f"{prefix}.{leaf}" if prefix else leaf)
    return out


def _fill_element(value: torch.Tensor) -> bytes | None:
    """The bytes of the one element every position of ``value`` holds, or None."""
    if value.numel() and all(st == 0 for st in value.stride()):
        # one element expanded (the made state of a weights-free torch export): never
        # materialized, which for a big model would cost the tensor's full size
        return tensor_bytes(value.detach().cpu().reshape(-1)[0].reshape(1).clone())
    flat = value.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.numel() == 0:
        return bytes(flat.element_size())
    bits = flat.view(_BITS[flat.element_size()])
    if not bool((bits == bits[0]).all()):
        return None
    return tensor_bytes(value.detach().cpu().reshape(-1)[:1])


def initial_section(
    s: StateRow, value: torch.Tensor, *, include_state: bool, non_persistent: set[str]
) -> tuple[SectionKind, bytes]:
    """The kind and bytes of state ``s``'s section, whose initial value is ``value``."""
    if include_state:
        if value.is_meta:
            raise MetaTensorError(
                f"State {s.name!r} is on the meta device: it has a shape but no values, and "
                "a bundle with its weights stores values. Export without weights "
                "(Recipe(include_state=False), stepbundle export --no-state), or give it "
                "values on the CPU first."
            )
        return SectionKind.TENSOR, tensor_bytes(value)
    model_state = s.kind is StateKind.PARAMETER or (
        s.kind is StateKind.BUFFER and not all(n in non_persistent for n in (s.name, *s.aliases))
    )
    if model_state:
        return SectionKind.EXTERNAL, b""
    if value.is_meta:
        if s.kind is StateKind.BUFFER:
            raise MetaTensorError(
                f"The buffer {s.name!r} is on the meta device and registered with "
                "persistent=False: no checkpoint holds it, so the bundle must store its "
                "values, and a meta tensor has none. Compute it on the CPU after building "
                "the model on meta (for rotary tables: model.<buffer> = <cos/sin made with "
                "device='cpu'>), then export."
            )
        return SectionKind.EXTERNAL, b""  # optimizer state with no values: a checkpoint's
    element = _fill_element(value)
    if element is not None:
        return SectionKind.FILL, element
    if s.kind is StateKind.BUFFER:
        return SectionKind.TENSOR, tensor_bytes(value)
    return SectionKind.EXTERNAL, b""
