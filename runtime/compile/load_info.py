"""How loading went: ``trainer.load_info``.

Imports: the runtime's program and fallback records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..fallback import PathChoice
from .compile_cache import CacheEvent

__all__ = ["LoadInfo"]


@dataclass
class LoadInfo:
    """How loading went.

    Attributes:
      seconds: wall seconds per stage (open, compile, state, ...).
      cache_hits: programs loaded from the compile cache.
      compiled: programs compiled.
      cache: per program (``"entry[i]"``), what the compile cache did and why: a hit,
        a miss with its reason (no entry, damaged, another program's entry, ...), or off;
        and any error writing the new entry.
        With ``steps_per_call`` K > 1 each train bucket's K-step loop has its own
        entry, ``"train[i]xK"`` (here and in ``dispatch``).
      transfer: how arrays are copied to the device (jaxlib's fast transfer, or the
        ``jax.device_put`` fallback and why); None until load() has placed the state.
      dispatch: per compiled program (``"entry[i]"``), how its steps are dispatched
        (result handlers, or the ``execute`` fallback and why).
      state_origins: per state entry, where its initial value came from: ``stored``
        (the bundle), ``rule`` (the bundle's fill) or ``file`` (``init_from``).
      ignored_tensors: tensors of ``init_from`` no state entry names (``init_strict=False``).
      matmul_precision: the precision set on every matmul and convolution before
        compiling (``CompileOptions(matmul_precision=...)``, or the manifest's); None for a
        bundle older than format 1.2 loaded without one: its programs keep their own.
      fused_attention: per compiled program (``"entry[i]"``), how many attentions run as
        fused kernels (on a TPU; ``CompileOptions.fused_attention``); empty for none.
      attention_kept: per compiled program, the attention composites (SDPA) a TPU kept
        as their decomposition, each with why in words (``fused_attention``'s others).
      head_barriers: per compiled program (``"entry[i]"``), what was done about the output
        head, in words (``CompileOptions.head_barriers``, ``runtime/compile/head_choice.py``):
        under "auto" on a TPU, where the residual stream was found fused into it, the fusion,
        libtpu's estimates with and without optimization barriers around the head's
        products and which was compiled; under True, how many products got barriers, or
        that the program has no head. Empty where nothing was weighed or asked (under
        "auto": off a TPU, eval entries, layouts over several devices, programs without a
        stream fused into the head). A program weighed has two events in ``cache``: its own
        label's and ``LABEL+head-barriers``, and ``compiled`` and ``cache_hits`` count both.
      bf16_products: per compiled program, (products compiled bf16-out, of them weight
        gradients in torch_xla's operand order) on a TPU (``CompileOptions.bf16_products``,
        ``stablehlo/bf16_products.py``); empty for none.
      regathered_products: per compiled program, the products that read a split
        parameter re-gathered behind a barrier (fsdp, fsdp+tp;
        ``CompileOptions.regather_weights``, ``stablehlo/regather.py``); empty for none.
      regather_choice: per compiled program under ``regather_weights="auto"`` that has
        products to re-gather a weight for, what was compared and kept, in words
        (``runtime/compile/regather_choice.py``): the memory XLA plans for the program as
        written against the device's, or the compiler's refusal, and, where the rewritten
        program was compiled too, what it needs. That compile has its own event in
        ``cache``, ``LABEL+regather-weights``, beside the label's own where the program as
        written compiled (a compile the compiler refused leaves no event). Empty where
        nothing was weighed (True, False, no such product).
      kept_freed_memory: whether glibc's allocator was told to keep freed memory
        before compiling (on a TPU; ``CompileOptions.keep_freed_memory``,
        ``runtime/compile/allocator.py``).
      allocator: what was decided about glibc's allocator and why, in words (the
        system-call cost measured for "auto"); empty off a TPU.
      auto_steps: what ``steps_per_call="auto"`` chose and why, in words
        (``runtime/auto_steps.py``); empty where K was given.
      cpu_numerics: on the CPU, what the programs were compiled with to be as accurate
        as PyTorch's CPU kernels, in words (``cpu_numerics.py``): long float sums in
        blocks or as written (``STEPBUNDLE_CPU_BLOCKED_SUMS=0``), and YNNPACK's fusions
        off per compile, left to the user's ``XLA_FLAGS``, or nothing to set on this
        jaxlib (``_compat.cpu_numerics_overrides``); empty off the CPU.
      layout: the parallel layout the state was placed in (``ParallelOptions.layout``,
        normalized: ``"dp"``, ``"zero1"``, ``"fsdp"``, ``"fsdp+tp:2"``, ...).
      mesh: the device mesh's axes and sizes (``{"data": 4}``, ``{"data": 2, "model":
        2}``).
      state_bytes_per_device: the most bytes of state any one device of this process
        holds (0 with ``compile_only``, which places nothing).
      layout_notes: what the layout split and did not, each in words
        (``ShardPlan.notes``): under ``+tp`` which parameters the rules split over the
        model axis (or that none), parameters a default tensor-parallel rule named but
        kept whole (the dimension does not divide by the model axis), lookup tables FSDP
        left split on the rows their lookup indexes, rules given to a layout without a
        model axis, and a layout on one device. ``stepbundle run`` prints each.
    """

    seconds: dict[str, float] = field(default_factory=dict)
    cache_hits: int = 0
    compiled: int = 0
    cache: dict[str, CacheEvent] = field(default_factory=dict)
    transfer: PathChoice | None = None
    dispatch: dict[str, PathChoice] = field(default_factory=dict)
    state_origins: dict[str, str] = field(default_factory=dict)
    ignored_tensors: tuple[str, ...] = ()
    matmul_precision: str | None = "default"
    fused_attention: dict[str, int] = field(default_factory=dict)
    attention_kept: dict[str, list[str]] = field(default_factory=dict)
    head_barriers: dict[str, str] = field(default_factory=dict)
    bf16_products: dict[str, tuple[int, int]] = field(default_factory=dict)
    regathered_products: dict[str, int] = field(default_factory=dict)
    regather_choice: dict[str, str] = field(default_factory=dict)
    kept_freed_memory: bool = False
    allocator: str = ""
    auto_steps: str = ""
    cpu_numerics: str = ""
    layout: str = "dp"
    mesh: dict[str, int] = field(default_factory=dict)
    state_bytes_per_device: int = 0
    layout_notes: tuple[str, ...] = ()
