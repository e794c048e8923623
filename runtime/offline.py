"""``compile_offline(path, devices, options)``: compile a bundle's programs for devices that
are described, not attached, and load nothing.

A TPU slice can be planned from a machine without its chips: jax's
``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:4x4")``
gives compile-only devices of a ``v5e-16``. ``compile_offline`` takes such a device list and
does what ``load`` does up to the compile, through ``load``'s own parts: the same layout
and placement (``placement/shard_plan.py``'s plan on a mesh of those devices, the packs),
the same checks and rewrites, the same compile options. It places no state and loads no
executable where the client can compile without loading (a topology's compile-only
client always can; the CPU client cannot, and loads), so what it hands back
answers questions only:
XLA's memory analysis per device (``get_compiled_memory_stats``), the compiled HLO (its
collectives), a serialized executable.

Imports: jax/jaxlib (through _compat), stepbundle.schema, the runtime's rooms and ``load``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import _compat
from .compile.compile_cache import CacheEvent, CacheOutcome, CompileCache
from .entry_compiler import EntryCompiler, scalar_constants
from .errors import UsageError
from .load import _layout_and_placement, _matmul_precision, _open_bundle, _wanted_entries
from .options import LoadOptions
from .placement.sharding import Placement

__all__ = ["OfflineCompile", "compile_offline"]


class _Unloaded(CompileCache):
    """A compile cache that keeps nothing: every program is compiled for the devices
    (which may exist only as a description) and handed back unloaded where the client
    can (``_compat.compile_unloaded``)."""

    def __init__(self) -> None:
        super().__init__(None)

    def _compile(
        self, client: Any, bytecode: bytes, devices: Sequence[Any], options: Any
    ) -> tuple[Any, CacheEvent]:
        exe = _compat.compile_unloaded(client, bytecode, devices, options)
        return exe, CacheEvent(CacheOutcome.OFF, "compiled offline, no cache")


@dataclass(frozen=True)
class OfflineCompile:
    """What ``compile_offline`` compiled, and how the run would be laid out.

    Attributes:
      placement: the devices and the sharding of every argument (``placement.layout``,
        ``placement.mesh_axes``, ``placement.plan``: which state tensor is split how).
      executables: ``"train[i]"`` -> the compiled, unloaded executable of that shape
        bucket: ``get_compiled_memory_stats()`` is XLA's plan of one device's memory,
        ``hlo_modules()`` the partitioned program.
      refused: ``"train[i]"`` -> why that bucket cannot run on these devices (its batch
        does not split over the data axis).
      fused_attention: ``"train[i]"`` -> how many attentions the TPU rewrite fused in
        that program (``load_info.fused_attention``); 0 on other platforms.
      attention_kept: ``"train[i]"`` -> the attention that program kept unfused on a
        TPU, each with why (``load_info.attention_kept``); absent where none was.
      head_barriers: ``"train[i]"`` -> what was done about the output head, in words
        (``load_info.head_barriers``); absent where nothing was weighed or asked.
      bf16_products: ``"train[i]"`` -> (products compiled bf16-out, of them weight
        gradients swapped) (``load_info.bf16_products``); absent where none was.
      regathered_products: ``"train[i]"`` -> products reading a re-gathered weight
        (``load_info.regathered_products``); absent where none was.
      regather_choice: ``"train[i]"`` -> what ``regather_weights="auto"`` compared and
        kept, in words (``load_info.regather_choice``); absent where nothing was weighed.
        The described devices of a slice report no memory: there only libtpu's refusal
        (or ``CompileOptions.device_memory``) makes it compile the rewritten program.
    """

    placement: Placement
    executables: dict[str, Any]
    refused: dict[str, str]
    fused_attention: dict[str, int]
    attention_kept: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    head_barriers: dict[str, str] = dataclasses.field(default_factory=dict)
    bf16_products: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    regathered_products: dict[str, int] = dataclasses.field(default_factory=dict)
    regather_choice: dict[str, str] = dataclasses.field(default_factory=dict)


def compile_offline(
    path: str | os.PathLike[str],
    devices: Sequence[Any],
    options: LoadOptions | None = None,
    *,
    buckets: Sequence[int] | None = None,
) -> OfflineCompile:
    """Compile the bundle at ``path`` for ``devices`` as ``load`` would, placing nothing.

    Args:
      path: the bundle (whatever ``load`` takes).
      devices: the devices of the run, in mesh order; compile-only devices of a topology
        (``jax.experimental.topologies``) or ordinary ones. Their count is the run's:
        ``options.parallel.devices`` must be it, 1 or ``"all"``.
      options: what ``load`` would be asked (the entries, the layout and its rules, the
        matmul precision, fused attention, packing); None: the defaults. Nothing is
        placed, as with ``compile_only``.
      buckets: the shape buckets to compile (their numbers); None: all of them.

    Example:
      >>> from jax.experimental import topologies  # doctest: +SKIP
      >>> devices = topologies.get_topology_desc("v5e:4x4", "tpu").devices  # doctest: +SKIP
      >>> out = compile_offline("llama.stepbundle", devices, LoadOptions(
      ...     parallel=ParallelOptions(layout="fsdp")))  # doctest: +SKIP
      >>> out.executables["train[0]"].get_compiled_memory_stats()  # doctest: +SKIP
    """
    devices = list(devices)
    if not devices:
        raise UsageError("compile_offline needs at least one device to compile for.")
    opts = options if options is not None else LoadOptions()
    asked = opts.parallel.devices
    if asked not in (1, "all", len(devices)):
        raise UsageError(
            f"compile_offline was given {len(devices)} device(s) but options ask for "
            f"devices={asked!r}. Pass that many devices, or leave devices at 1 or 'all'."
        )
    opts = dataclasses.replace(
        opts, parallel=dataclasses.replace(opts.parallel, devices=len(devices))
    )
    bundle = _open_bundle(path, opts.safety.expect_digest)
    executables: dict[str, Any] = {}
    refused: dict[str, str] = {}
    fused: dict[str, int] = {}
    kept: dict[str, list[str]] = {}
    heads: dict[str, str] = {}
    narrow: dict[str, tuple[int, int]] = {}
    regathered: dict[str, int] = {}
    regather_choice: dict[str, str] = {}
    try:
        manifest = bundle.manifest
        wanted = _wanted_entries(manifest, opts)
        layout, placement = _layout_and_placement(manifest, opts, devices, bundle, wanted)
        compiler = EntryCompiler(
            client=devices[0].client,
            placement=placement,
            layout=layout,
            cache=_Unloaded(),
            matmul_precision=_matmul_precision(bundle, opts.compile.matmul_precision),
            donate=not opts.safety.stop_on_nonfinite,
            fused_attention=opts.compile.fused_attention,
            head_barriers=(
                None if opts.compile.head_barriers == "auto" else bool(opts.compile.head_barriers)
            ),
            bf16_products=opts.compile.bf16_products,
            regather_weights=opts.compile.regather_weights,
            device_memory=opts.compile.device_memory,
            initial=None,  # no state is read: masks are not evaluated (as compile_only)
        )
        for name in wanted:
            entry = manifest.entries[name]
            for i, program in enumerate(entry.programs):
                if buckets is not None and i not in buckets:
                    continue
                label = f"{name}[{i}]"
                why = placement.indivisible(program)
                if why is not None:
                    refused[label] = why
                    continue
                compiled = compiler._compile(
                    bundle.section(program.section),
                    program,
                    name,
                    i,
                    entry.updates_state,
                    scalar_constants(bundle, program),
                )
                executables[label] = compiled.executable
                fused[label] = compiled.fused_attention
                if compiled.attention_kept:
                    kept[label] = list(compiled.attention_kept)
                if compiled.head_choice:
                    heads[label] = compiled.head_choice
                if compiled.bf16_products:
                    narrow[label] = (compiled.bf16_products, compiled.bf16_weight_gradients)
                if compiled.regathered_products:
                    regathered[label] = compiled.regathered_products
                if compiled.regather_choice:
                    regather_choice[label] = compiled.regather_choice
    finally:
        bundle.close()
    return OfflineCompile(
        placement, executables, refused, fused, kept, heads, narrow, regathered, regather_choice
    )
