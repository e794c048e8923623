"""The fused attention kernels under a device mesh: one kernel call per shard.

A Pallas call is not partitioned by XLA's SPMD partitioner: a program over several
devices that called ``fused_attention.composite_kernel``'s function as it is would run
it on the whole global batch everywhere (or not compile). Here each attention composite's
kernel is wrapped in ``jax.shard_map`` over the program's mesh: q, k, v, the output and
its gradient split on the batch over ``data`` and on the heads over ``model`` (when the
mesh has one), lse likewise; each device runs the kernel on its own sequences and heads,
which is all attention reads (no collective inside). The partitioner reshards q, k and v
to that split where its propagation gave them another.

The function is lowered over an abstract mesh of the program's axes and sizes
(``jax.sharding.AbstractMesh``), so its ``sdy.manual_computation`` names a mesh of its
own; ``share_mesh`` points every such reference at the program's (``@stepbundle_mesh``,
``placement/sharding.py``) and drops the copies, so the kernels and the program are
partitioned over one mesh.

A composite whose batch does not divide the data axis (or whose heads, or key/value
heads, do not divide the model axis) keeps its decomposition, and ``mesh_refusal`` says
why in words (``load_info.attention_kept``).

Imports: jax (shard_map, its Pallas kernels), stepbundle.stablehlo.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.artifact import ProgramError
from stepbundle.stablehlo.attention_composite import Attention

from ..fallback import warn_once
from ..placement.shard_plan import DATA, MODEL
from ..placement.sharding import MESH
from .fused_attention import _lower, composite_avals, composite_kernel, composite_supported

if TYPE_CHECKING:
    from .stage import RewriteContext, Stage

__all__ = ["declares_mesh", "fuse_on_mesh", "mesh_kernels_for", "mesh_refusal", "share_mesh"]

Axes = Sequence[tuple[str, int]]


def _sizes(axes: Axes) -> tuple[int, int]:
    sizes = dict(axes)
    return sizes.get(DATA, 1), sizes.get(MODEL, 1)


def mesh_refusal(att: Attention, axes: Axes) -> str | None:
    """Why ``att`` cannot run as one kernel call per shard of a mesh of ``axes``, or
    None when it can."""
    data, model = _sizes(axes)
    if att.batch % data:
        return (
            f"its batch ({att.batch}) does not split over the {data} devices of the data axis "
            "(the fused kernels run one call per shard of the batch)"
        )
    if att.heads % model or att.kv_heads % model:
        return (
            f"its {att.heads} heads ({att.kv_heads} key/value heads) do not split over the "
            f"{model} devices of the model axis (the fused kernels run one call per shard of "
            "the heads)"
        )
    return None


def _shard_map(fn: Any, mesh: Any, in_specs: Any, out_specs: Any) -> Any:
    import jax

    # check_vma: the kernels' outputs vary over every axis they are split on, as declared
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def mesh_kernels_for(platform: str, axes: Axes, interpret: bool = False) -> Any:
    """A ``stablehlo.attention_composite.Kernels`` callable for a program partitioned
    over a mesh of ``axes`` (``Placement.mesh_axes``): each composite's kernel under
    ``jax.shard_map``, the arrays split on batch over ``data`` and on heads over
    ``model``. Raises ImportError or AttributeError on a jax without ``jax.shard_map``
    or abstract meshes."""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as _P

    P: Any = _P
    names = tuple(a for a, _ in axes)
    mesh = AbstractMesh(tuple(n for _, n in axes), names)
    data, model = _sizes(axes)
    # Rank 4 (B, H, T, D) and lse's rank 3 (B, H, T): batch then heads
    split = P(DATA, MODEL) if MODEL in names else P(DATA)

    def make(att: Attention) -> str:
        local = dataclasses.replace(
            att, batch=att.batch // data, heads=att.heads // model, kv_heads=att.kv_heads // model
        )
        fn = composite_kernel(local, interpret)
        q, k, v, out, lse = composite_avals(att)
        if not att.grad:
            sharded = _shard_map(fn, mesh, (split,) * 3, (split, split))
            return _lower(sharded, platform, q, k, v)
        sharded = _shard_map(fn, mesh, (split,) * 6, (split,) * 3)
        return _lower(sharded, platform, out, q, k, v, out, lse)

    return make


def _meshes(module: mlir.Module) -> list[Any]:
    return [op for op in module._module.body.operations if op.operation.name == "sdy.mesh"]


def _axes_of(op: Any) -> list[tuple[str, int]]:
    from jaxlib.mlir.dialects import sdy as _sdy

    sdy: Any = _sdy
    mesh = sdy.MeshAttr(op.attributes["mesh"])
    return [(str(x.name), int(x.size)) for x in (sdy.MeshAxisAttr(a) for a in mesh.axes)]


def share_mesh(module: mlir.Module, name: str, axes: Axes) -> int:
    """Declare the mesh ``name`` of ``axes`` in ``module`` (``Module.set_mesh``) and
    point every other mesh's references at it, dropping those meshes (the ones the
    kernels were lowered with), in place; returns how many were dropped.

    Raises:
      ProgramError: another mesh has other axes (it cannot be the program's).
    """
    from jaxlib.mlir import ir

    want = [(a, n) for a, n in axes]
    with module._ctx:
        own = [
            op for op in _meshes(module) if ir.StringAttr(op.attributes["sym_name"]).value == name
        ]
        others = [op for op in _meshes(module) if op not in own]
    if not own:
        module.set_mesh(name, want)
    with module._ctx:
        for op in others:
            old = ir.StringAttr(op.attributes["sym_name"]).value
            if _axes_of(op) != want:
                raise ProgramError(
                    f"the fused attention's mesh @{old} has axes {_axes_of(op)}, the program's "
                    f"{want}"
                )
            ir.SymbolTable.replace_all_symbol_uses(old, name, module._module.operation)
            op.operation.erase()
    return len(others)


def declares_mesh(module: mlir.Module, name: str) -> bool:
    """Whether ``module`` declares the mesh ``name`` already (``share_mesh`` did)."""
    from jaxlib.mlir import ir

    with module._ctx:
        return any(ir.StringAttr(op.attributes["sym_name"]).value == name for op in _meshes(module))


WRITTEN_OUT = (
    "written-out attention (matched in the program, not an SDPA composite) is not fused "
    "over several devices: the kernels under a mesh take the composites the torch "
    "front-end writes for F.scaled_dot_product_attention"
)


def fuse_on_mesh(
    stage: Stage, ctx: RewriteContext, platform: str, interpret: bool = False
) -> Stage:
    """``rewrites.fuse_attention`` for a program partitioned over several devices: each
    attention composite the kernels and the mesh take (``composite_supported``,
    ``mesh_refusal``) as one kernel call per shard; the others keep their decomposition
    and ``ctx.kept_attention`` says why (as does a warning, once per reason). A failure
    (a jax without ``jax.shard_map``, a lowering or verification error) keeps the
    program as it is and says so the same way."""
    from stepbundle.stablehlo.attention import find_attention
    from stepbundle.stablehlo.attention_composite import find_composites, rewrite_composites

    axes = ctx.placement.mesh_axes
    found = [att for _, att in find_composites(stage.module)]
    kept: list[str] = []
    fused = 0
    copy = mlir.Module.parse_text(stage.module, stage.module.text())
    reads: set[int] = set()
    if found:
        try:
            kernels = mesh_kernels_for(platform, axes, interpret)
            done, kept = rewrite_composites(
                copy,
                kernels,
                lambda att: composite_supported(att) or mesh_refusal(att, axes),
                dict(ctx.scalar_constants),
                ctx.state_values,
                reads,
            )
            fused = sum(1 for a in done if not a.grad)
            if done:
                share_mesh(copy, MESH, axes)
        except Exception as e:  # no shard_map, lowering, verification: keep the program
            import jax

            why = f"the fused kernels under a device mesh failed on jax {jax.__version__}: {e}"
            copy, fused, reads = stage.module, 0, set()
            kept = [f"{a.describe()}: {why}" if a is not None else why for a in found]
    misses: list[str] = []
    if find_attention(copy, dict(ctx.scalar_constants), misses, ctx.state_values):
        kept.append(WRITTEN_OUT)
    ctx.kept_attention.extend(kept)
    ctx.pinned_state.extend(ctx.state_values[i][0] for i in sorted(reads))
    for why in dict.fromkeys(kept):
        warn_once(
            f"fused-attention-kept:{why}",
            f"stepbundle kept attention as its decomposition (slower on a TPU): {why}",
        )
    ctx.notes["fused_attention"] = fused
    return dataclasses.replace(stage, module=copy) if fused else stage
