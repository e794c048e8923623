"""Whether a mask over attention scores is the causal one, as ``attention.py``'s matcher
asks of every mask it finds: a boolean mask applied with ``select`` (kept where true, or
filled where true) and a float mask added to the scores. Each is recognized by its form
(an iota comparison) or else computed when the program is compiled (``graph.evaluate``),
with state the step never writes read as loaded; the answer is "" or the reason, in words
a user can act on, and the state arguments the mask was read from.

Imports: jaxlib's MLIR bindings (through ``graph``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .graph import (
    StateValues,
    element_type,
    holds_integers,
    ints,
    producer,
    shape_of,
    splat_value,
)
from .mask_values import compute_mask, is_causal

__all__ = ["FILL_AT_MOST", "NOT_CAUSAL", "additive_miss", "iota_rows_ge_columns", "mask_miss"]

FILL_AT_MOST = -1e30
"""A masked score at or below this gives exactly zero probability in float32 (with the
causal mask every row keeps its diagonal, so its maximum is a real score)."""


def iota_rows_ge_columns(value: Any, t: int) -> bool:
    """``value`` is ``compare GE(broadcast(iota, [0]), broadcast(iota, [1]))`` over (T, T)
    (what ``torch.ones(t, t).tril()`` traces to), possibly as ``select(it, true, false)``:
    recognized without computing its T*T elements."""
    op = producer(value)
    if op is not None and op.name == "stablehlo.select":
        if splat_value(op.operands[1], {}) != 1.0 or splat_value(op.operands[2], {}) != 0.0:
            return False
        op = producer(op.operands[0])
    if (
        op is None
        or op.name != "stablehlo.compare"
        or "GE" not in str(op.attributes["comparison_direction"])
    ):
        return False
    sides = [producer(v) for v in op.operands]
    if any(s is None or s.name != "stablehlo.broadcast_in_dim" for s in sides):
        return False
    if [ints(s, "broadcast_dimensions") for s in sides] != [[0], [1]]:
        return False
    iotas = [producer(s.operands[0]) for s in sides]
    # The positions must be exact in the iota's type: 0..T-1 rounded to bf16 (T > 257)
    # or wrapped in i8 (T > 128) compare into another mask.
    return all(
        i is not None
        and i.name == "stablehlo.iota"
        and shape_of(i.result) == [t]
        and holds_integers(element_type(i.result), t)
        for i in iotas
    )


NOT_CAUSAL = "a mask over the scores that is not provably causal"
"""The start of every reason ``mask_miss`` gives."""


def mask_miss(
    select: Any,
    t: int,
    scalars: dict[int, float],
    seen: dict[Any, tuple[str, tuple[int, ...]]],
    state: StateValues,
    fills_where_true: bool,
    names: Mapping[int, str] | None = None,
) -> tuple[str, tuple[int, ...]]:
    """Why ``select``'s predicate is not the causal mask of a (T, T) score broadcast over
    the batch and heads (the last two dims exactly), or "" when it is, and the state
    arguments it was computed from. The predicate keeps the scores where it is true (the
    lower triangle), or with ``fills_where_true`` fills them (the strict upper one).
    Checked once per mask (the layers of a model share one), by its form or else by
    computing it with each value held as its element type holds it (``graph.evaluate``),
    state read as loaded (``state``)."""
    pred = select.operands[0]
    bcast = producer(pred)
    whole = f"{NOT_CAUSAL} (not one (T, T) mask broadcast over the batch and heads)"
    rank = len(shape_of(pred))
    if shape_of(pred)[:-2] == [1] * (rank - 2):
        mask = pred  # one batch of one head: the mask is the whole predicate
    elif bcast is None or bcast.name != "stablehlo.broadcast_in_dim":
        return whole, ()
    else:
        mask = bcast.operands[0]
        # (T, T) into the last two dims, or (1, .., 1, T, T) broadcast over the
        # leading ones (the torch front-end keeps a buffer's unit dims)
        if ints(bcast, "broadcast_dimensions")[-2:] != [rank - 2, rank - 1]:
            return whole, ()
    mask_shape = shape_of(mask)
    if mask_shape[-2:] != [t, t] or any(n != 1 for n in mask_shape[:-2]):
        return whole, ()
    if element_type(mask) != "i1":
        return whole, ()
    key = (producer(mask), fills_where_true)
    if key[0] is not None and key in seen:
        return seen[key]
    miss = ""
    reads: tuple[int, ...] = ()
    if fills_where_true or mask_shape != [t, t] or not iota_rows_ge_columns(mask, t):
        computed = compute_mask(mask, scalars, state, names)
        reads = computed.reads
        loaded = ", ".join(state[num][0] for num in reads)
        if computed.values is None:
            miss = f"{NOT_CAUSAL} ({computed.why})"
        elif not is_causal(
            computed.values,
            (lambda v: not v) if fills_where_true else bool,
            bool if fills_where_true else (lambda v: not v),
        ):
            miss = f"{NOT_CAUSAL} (computed, it is not the causal triangle" + (
                f"; from the loaded value of {loaded})" if loaded else ")"
            )
    if key[0] is not None:
        seen[key] = (miss, reads)
    return miss, reads


def additive_miss(
    add: Any,
    x: Any,
    t: int,
    scalars: dict[int, float],
    seen: dict[Any, tuple[str, tuple[int, ...]]],
    state: StateValues,
    names: Mapping[int, str] | None = None,
) -> tuple[str, tuple[int, ...]]:
    """Why ``add`` (the scores ``x`` plus a mask) is not a causal additive mask, or ""
    when it is, and the state arguments the mask was computed from. The mask is
    broadcast into the scores' last two dims and each of its (T, T) slices (one per
    batch row or head it holds) must be 0 on the lower triangle and at most
    ``FILL_AT_MOST`` above it, computed as ``mask_miss`` computes a mask."""
    addend = add.operands[1] if add.operands[0] == x else add.operands[0]
    bcast = producer(addend)
    rank = len(shape_of(x))
    whole = f"{NOT_CAUSAL} (an added mask that is not one (T, T) mask per batch row or head)"
    mask = addend
    if bcast is not None and bcast.name == "stablehlo.broadcast_in_dim":
        if ints(bcast, "broadcast_dimensions")[-2:] != [rank - 2, rank - 1]:
            return whole, ()
        mask = bcast.operands[0]
    if shape_of(mask)[-2:] != [t, t]:
        return whole, ()
    key = (producer(mask), "additive")
    if key[0] is not None and key in seen:
        return seen[key]
    computed = compute_mask(mask, scalars, state, names)
    reads, miss = computed.reads, ""
    if computed.values is None:
        miss = f"{NOT_CAUSAL} (an added mask {computed.why})"
    elif not is_causal(computed.values, lambda v: v == 0.0, lambda v: v <= FILL_AT_MOST):
        miss = f"{NOT_CAUSAL} (an added mask that, computed, is not the causal one)"
    if key[0] is not None:
        seen[key] = (miss, reads)
    return miss, reads
