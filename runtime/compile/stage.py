"""What a load-time rewrite takes and gives: the module on its way to the compiler
(``Stage``) and what the rewrite may depend on (``RewriteContext``). Their own module so
that the rewrites (``rewrites.py``) and the modules it calls (``mesh_attention.py``) share
them without importing each other.

Imports: stepbundle.schema, stepbundle.stablehlo, the runtime's placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from stepbundle.schema.manifest import Program
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.attention import StateValues

from ..placement import packing
from ..placement.sharding import Placement

__all__ = ["RewriteContext", "Stage"]


@dataclass(frozen=True)
class RewriteContext:
    """What a rewrite may depend on besides the module and its manifest record.

    Attributes:
      platform: the PJRT platform compiled for ("cpu", "cuda", "rocm", "tpu").
      placement: the devices, and how each argument and result is sharded over them.
      layout: how the trainer holds the state (packs of small tensors), or None.
      donate: whether state inputs are donated to their updates.
      steps_per_call: K > 1 compiles the step behind a loop of K steps.
      matmul_precision: "default", "high" or "highest" for every matmul and
        convolution, or None to keep the program's own.
      fused_attention: whether a TPU runs traced attention as fused kernels.
      blocked_sums: whether a CPU program's long float sums are summed in blocks
        (``cpu_numerics.py``).
      head_barriers: put optimization barriers around the output head's products
        (``stablehlo/head_barriers.py``); ``compile_program`` decides where
        (``head_choice.py``).
      bf16_products: on a TPU, write float32-out bf16 products that are rounded to bf16
        at once bf16-out (``stablehlo/bf16_products.py``).
      regather_weights: under fsdp and fsdp+tp, give a split parameter's later products
        their own copy behind a barrier (``stablehlo/regather.py``); False counts them in
        ``notes["regather_sites"]`` (``compile_program`` decides, ``regather_choice.py``).
      scalar_constants: @main's scalar constant arguments (argument number -> value,
        from the bundle's constant sections): an attention mask's fill value is one.
      state_values: the state arguments the step never writes, as loaded
        (``stablehlo.attention.StateValues``): a causal mask held in a buffer is one.
        A rewrite that depends on one names it in ``pinned_state``.
      notes: what rewrites report back to the load (``"fused_attention"``: how many
        attentions were fused); filled in by the rewrites, not part of the key.
      kept_attention: attention composites kept as their decomposition on a platform
        that fuses, each with why (``fused-attention``); filled in like ``notes``.
      pinned_state: the state (by name) whose loaded value the rewritten program
        assumes (``runtime/compile/state_masks.py``); filled in like ``notes``.
    """

    platform: str
    placement: Placement
    layout: packing.Layout | None = None
    donate: bool = False
    steps_per_call: int = 1
    matmul_precision: str | None = None
    fused_attention: bool = True
    blocked_sums: bool = True
    head_barriers: bool = False
    bf16_products: bool = True
    regather_weights: bool = True
    scalar_constants: Mapping[int, float] = field(default_factory=dict)
    state_values: StateValues = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    kept_attention: list[str] = field(default_factory=list)
    pinned_state: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Stage:
    """A module on its way to the compiler, and the record of its arguments and results."""

    module: mlir.Module
    program: Program
