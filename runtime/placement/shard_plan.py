"""Which state tensor is split on which dimension over which mesh axis, for a layout.

``plan_shards`` reads the manifest's state table and a ``ParallelLayout``
(``layout_spec.py``) and gives every state tensor a mesh axis per dimension
(``None``: that dimension is whole on every device):

- tensor parallelism (``+tp``): each parameter the first matching ``ShardRule`` names is
  split on the rule's dimension over ``model``; its kept gradient and its optimizer
  state of the same shape follow it;
- ZeRO-1 (``zero1``): each optimizer-state tensor is split over ``data`` on its first
  dimension that divides by the data axis and is not split over ``model``;
- FSDP (``fsdp``): the same for parameters, kept gradients and optimizer state, but a
  table the program looks rows up in (an embedding: ``lookups``, from
  ``stablehlo/lookups.py``) is split on a dimension the lookup takes whole (its width)
  where one divides: split on the rows it indexes, the partitioner gathers the whole
  table onto every device for the lookup and all-reduces its whole gradient (#41).

Buffers (BatchNorm's statistics) and scalars stay replicated; so does a tensor none of
whose dimensions divides. The plan is what the partitioner is told; the program is
the bundle's own.

Imports: stepbundle.schema and the runtime's base modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stepbundle.schema.manifest import Manifest, StateEntry, StateKind

from .layout_spec import (
    DEFAULT_TP_RULES,
    DataSplit,
    LayoutError,
    ParallelLayout,
    ShardRule,
    rule_for,
)

__all__ = ["DATA", "MODEL", "ShardPlan", "plan_shards"]

DATA = "data"
MODEL = "model"

Dims = tuple[str | None, ...]


@dataclass(frozen=True)
class ShardPlan:
    """Every split state tensor's mesh axis per dimension.

    Attributes:
      layout: the layout planned for.
      data: devices on the data axis.
      model: devices on the model axis (1: a 1-D mesh).
      dims: state name -> one entry per dimension: ``"data"``, ``"model"`` or None
        (whole). Replicated tensors are left out.
      notes: what the layout did not do as asked, each in words: parameters a default
        tensor-parallel rule named but could not split (the dimension does not divide),
        lookup tables split on a dimension their lookup indexes (no other divides),
        rules given to a layout without a model axis, a layout on one device; and under
        ``+tp``, which parameters the rules split over the model axis (or that none).
    """

    layout: ParallelLayout
    data: int
    model: int
    dims: Mapping[str, Dims]
    notes: tuple[str, ...] = ()

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """The mesh's axes and sizes: ``(("data", 4),)`` or ``(("data", 2), ("model", 2))``."""
        return ((DATA, self.data),) + (((MODEL, self.model),) if self.model > 1 else ())


def _owner(entry: StateEntry, params: Mapping[str, StateEntry]) -> StateEntry | None:
    """The parameter an optimizer-state tensor or kept gradient belongs to, if any.

    Names are ``optimizer.state.<param name>.<key>`` and ``<param name>.grad``.
    """
    name = entry.name
    if entry.kind == StateKind.GRADIENT and name.endswith(".grad"):
        return params.get(name.removesuffix(".grad"))
    if entry.kind == StateKind.OPTIMIZER_STATE and name.startswith("optimizer.state."):
        return params.get(name.removeprefix("optimizer.state.").rpartition(".")[0])
    return None


def _tp_dim(
    param: StateEntry, rules: tuple[ShardRule, ...], model: int, held: bool, notes: list[str]
) -> int | None:
    """The dimension of ``param`` split over the model axis, or None.

    ``held``: the rules are the user's, so one that cannot be applied is refused (the
    default rules among them, ``DEFAULT_TP_RULES``' own objects, keep a parameter whole
    with a note instead, as without rules).
    """
    rule = rule_for(param.name, rules)
    if rule is None:
        return None
    held = held and not _is_default(rule)
    shape = param.spec.shape
    rank = len(shape)
    if not -rank <= rule.dim < rank:
        if held:
            raise LayoutError(
                f"The tensor-parallel rule {str(rule)!r} splits dimension {rule.dim} of "
                f"{param.name!r}, which has shape {list(shape)} ({rank} dimension"
                f"{'' if rank == 1 else 's'}). Fix "
                "the rule's dimension or narrow its pattern."
            )
        notes.append(f"{param.name} {list(shape)}: no dimension {rule.dim} (rule {rule})")
        return None
    dim = rule.dim % rank
    if shape[dim] % model:
        if held:
            raise LayoutError(
                f"The tensor-parallel rule {str(rule)!r} splits dimension {dim} of "
                f"{param.name!r} (shape {list(shape)}) over a model axis of {model} "
                f"devices, but {shape[dim]} does not divide by {model}. Use a model axis "
                f"that divides it (--layout ...+tp:M), another dimension, or a rule that "
                "leaves this parameter out."
            )
        notes.append(
            f"{param.name} {list(shape)} kept whole on the model axis: dimension {dim} "
            f"({shape[dim]}) does not divide by {model} (rule {rule})"
        )
        return None
    return dim


def _is_default(rule: ShardRule) -> bool:
    """Whether ``rule`` is one of ``DEFAULT_TP_RULES`` (the object, not an equal rule a
    user wrote: a user's rule that cannot be applied is refused)."""
    return any(rule is d for d in DEFAULT_TP_RULES)


def _data_dim(
    shape: tuple[int, ...], data: int, taken: int | None, indexed: frozenset[int] = frozenset()
) -> int | None:
    """The first dimension of ``shape`` that divides by ``data`` and is not ``taken``,
    one a lookup does not index (``indexed``) first."""
    free = [d for d, size in enumerate(shape) if d != taken and size % data == 0]
    return next((d for d in free if d not in indexed), free[0] if free else None)


def _tp_summary(params: list[str], tp: Mapping[str, int], held: bool) -> str:
    """What the tensor-parallel rules split over the model axis, in words: the first six
    parameters split, each as ``NAME:DIM``."""
    split = [name for name in params if name in tp]
    if not split:
        whose = "your rules" if held else "the default rules (DEFAULT_TP_RULES)"
        return (
            f"no parameter is split over the model axis: {whose} match none of this "
            "bundle's parameters that divide; write rules for its names "
            "(--tp-rule PATTERN:DIM, or ParallelOptions(tp_rules=...); docs/parallel.md)"
        )
    # NAME:DIM, as --tp-rule writes a rule: which dimension of each was split
    shown = ", ".join(f"{name}:{tp[name]}" for name in split[:6]) + (
        ", ..." if len(split) > 6 else ""
    )
    return f"{len(split)} of {len(params)} parameters split over the model axis: {shown}"


def plan_shards(
    manifest: Manifest,
    layout: ParallelLayout,
    n_devices: int,
    rules: tuple[ShardRule, ...] | None = None,
    lookups: Mapping[str, frozenset[int]] | None = None,
) -> ShardPlan:
    """The split of every state tensor of ``manifest`` over ``n_devices`` in ``layout``.

    ``lookups``: parameter name -> the dimensions the program's lookups index in it
    (``stablehlo.lookups.lookup_dims``); the data split of the parameter, and of its
    gradient and optimizer state, avoids them where another dimension divides.

    Raises ``LayoutError`` when the model axis does not divide the device count, or when
    a rule of ``rules`` (the user's: None means ``DEFAULT_TP_RULES``) cannot be applied.
    """
    model = layout.model
    if n_devices % model:
        raise LayoutError(
            f"The layout {layout.spec!r} puts {model} devices on the model axis, which does "
            f"not divide the {n_devices} device(s) of this run. Run on a multiple of "
            f"{model} devices or choose a model axis that divides {n_devices}."
        )
    data = n_devices // model
    held = rules is not None
    use = rules if rules is not None else DEFAULT_TP_RULES
    notes: list[str] = []
    params = {s.name: s for s in manifest.state if s.kind == StateKind.PARAMETER}
    tp: dict[str, int] = {}
    if model > 1:
        for p in params.values():
            dim = _tp_dim(p, use, model, held, notes)
            if dim is not None:
                tp[p.name] = dim
        if held:
            for rule in use:
                if not _is_default(rule) and not any(rule.matches(name) for name in params):
                    raise LayoutError(
                        f"The tensor-parallel rule {str(rule)!r} matches no parameter of "
                        f"this bundle (its parameters: {', '.join(list(params)[:8])}"
                        f"{', ...' if len(params) > 8 else ''}). Fix its pattern or drop it."
                    )
        notes.append(_tp_summary(list(params), tp, held))
    elif rules:
        notes.append(
            f"{len(rules)} tensor-parallel rule(s) given, but the layout {layout.spec!r} has "
            "no model axis: they split nothing (a layout ending in +tp[:M] uses them)"
        )
    if n_devices == 1 and (layout.data != DataSplit.DP or model > 1):
        notes.append(
            f"the layout {layout.spec!r} on 1 device splits nothing (on a CPU, --devices N "
            "or stepbundle.runtime.set_cpu_devices(N) makes N virtual devices)"
        )
    split_kinds = {
        DataSplit.DP: frozenset[StateKind](),
        DataSplit.ZERO1: frozenset({StateKind.OPTIMIZER_STATE}),
        DataSplit.FSDP: frozenset(
            {StateKind.PARAMETER, StateKind.GRADIENT, StateKind.OPTIMIZER_STATE}
        ),
    }[layout.data]
    dims: dict[str, Dims] = {}
    whole: list[str] = []  # tensors the data split takes and could not split
    for entry in manifest.state:
        shape = entry.spec.shape
        if not shape:
            continue
        owner = entry if entry.kind == StateKind.PARAMETER else _owner(entry, params)
        taken = None
        indexed = frozenset[int]()
        if owner is not None and owner.spec.shape == shape:
            taken = tp.get(owner.name)
            indexed = (lookups or {}).get(owner.name, indexed)
        plan: list[str | None] = [None] * len(shape)
        if taken is not None:
            plan[taken] = MODEL
        if data > 1 and entry.kind in split_kinds:
            d = _data_dim(shape, data, taken, indexed)
            if d is None:
                whole.append(f"{entry.name} {list(shape)}")
            if d is not None:
                plan[d] = DATA
                if d in indexed and entry is owner:
                    notes.append(
                        f"{entry.name} {list(shape)} split over data on dimension {d}, "
                        "which a lookup indexes: no other dimension is free to split (each "
                        f"is split over model or does not divide by {data}), so the "
                        "partitioner gathers it whole for the lookup"
                    )
        if any(a is not None for a in plan):
            dims[entry.name] = tuple(plan)
    if whole:
        notes.append(
            f"{len(whole)} tensor(s) the layout {layout.spec!r} splits over data are kept "
            f"whole on every device, no free dimension dividing by {data}: "
            + ", ".join(whole[:6])
            + (", ..." if len(whole) > 6 else "")
        )
    return ShardPlan(layout, data, model, dims, tuple(notes))
