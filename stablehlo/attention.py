"""Traced attention found in a training step (``attention_rewrite.py`` swaps it).

Written in PyTorch as ``softmax(q @ k.T * scale, masked) @ v``, attention reaches a
bundle as two batched matrix products around a softmax over a (T, T) matrix per head,
and its backward as four more products and the softmax's gradient over matrices of that
size. On a TPU those operations are a large part of a small transformer's step, where a
fused kernel reads only q, k and v (docs/tpu.md, "Fused attention", has the profile and
the figures).

``find_attention`` matches the pattern torch_xla writes (matched op by op, with every
intermediate's uses accounted for, so nothing else reads a value that would disappear):

    s = dot_general(q, kt)          q: (B*H, T, D), kt: (B*H, D, T), batch dim 0
    s = reshape(s) to (B, H, T, T); [convert]; multiply(s, broadcast(scale)); [convert]
    s = select(broadcast(mask), s, broadcast(fill))   optional; mask causal (checked by
                                                      evaluating it, in its element
                                                      types), fill <= -1e30; or
                                                      select(upper, fill, s) (nanoGPT's
                                                      masked_fill(bias == 0, -inf)),
                                                      a state buffer read as loaded
    p = softmax over the last dim   reduce max, subtract, exp, reduce add, divide
    o = dot_general(reshape([convert] p), v)

and, when the step trains, its backward: ``dv = dot(transpose(p), do)``, ``dp =
dot(do, vt)``, the softmax gradient ``p * (dp - sum(dp * p))``, the mask's zeros, the
scale, then ``dq = dot(ds, k)`` and ``dkt = dot(qt, ds)``.

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .artifact import Module
from .attention_masks import FILL_AT_MOST, NOT_CAUSAL, additive_miss, mask_miss
from .graph import (
    StateValues,
    element_type,
    ints,
    only_user,
    producer,
    shape_of,
    skip_converts,
    source_of,
    splat_value,
    uses_of,
)
from .inline import inline_private_calls

__all__ = ["NOT_CAUSAL", "Site", "StateValues", "count_score_products", "find_attention"]


@dataclass
class Site:
    """One attention found in a module.

    Attributes:
      batch, heads, length, head_dim: B, H, T, D.
      dtype: q's element type as MLIR prints it (``bf16``).
      scale_dtype: the scale's element type.
      causal: whether the scores were masked causally (else not masked at all).
      q, kt, v, scale: the values the forward reads (``scale`` a scalar).
      out: the forward's product ``o`` (replaced).
      do: the output's gradient, None when the step has no backward.
      dq, dkt, dv: the backward's products (replaced), or None.
      divides: the scores were divided by ``scale`` (``/ math.sqrt(d)``), not
        multiplied by it.
      fills_where_true: the mask ``select`` takes the fill where its predicate is true
        (``masked_fill(bias == 0, -inf)``), not the score.
      state_reads: the state arguments (``StateValues``) the mask was computed from.
      probs, probs_product, mask_select, first_grad: what matching the backward reads
        (the float32 probabilities, their reshape the output product reads, the
        forward's mask ``select``) and where the backward call goes (the first of the
        three gradient products).
    """

    batch: int
    heads: int
    length: int
    head_dim: int
    dtype: str
    scale_dtype: str
    causal: bool
    q: Any
    kt: Any
    v: Any
    scale: Any
    out: Any
    do: Any = None
    dq: Any = None
    dkt: Any = None
    dv: Any = None
    divides: bool = False
    fills_where_true: bool = False
    state_reads: tuple[int, ...] = ()
    probs: Any = field(default=None, repr=False)
    probs_product: Any = field(default=None, repr=False)
    mask_select: Any = field(default=None, repr=False)
    first_grad: Any = field(default=None, repr=False)

    @property
    def key(self) -> tuple[int, int, int, int, str, str, bool, bool, bool]:
        """What the fused functions depend on."""
        return (
            self.batch,
            self.heads,
            self.length,
            self.head_dim,
            self.dtype,
            self.scale_dtype,
            self.causal,
            self.do is not None,
            self.divides,
        )


_BATCHED = (
    "#stablehlo.dot<lhs_batching_dimensions = [0], rhs_batching_dimensions = [0], "
    "lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [1]>"
)


def _batched_matmul(op: Any) -> bool:
    """(n, a, b) x (n, b, c) -> (n, a, c), batch dim 0, nothing else."""
    if op is None or op.name != "stablehlo.dot_general":
        return False
    if any(len(shape_of(v)) != 3 for v in (*op.operands, op.result)):
        return False
    return str(op.attributes["dot_dimension_numbers"]) == _BATCHED


_INIT = {"max": float("-inf"), "add": 0.0}
"""The identity each reduce must start from (a max from -inf, a sum from zero)."""


def _reduce_kind(op: Any) -> str | None:
    """``max`` or ``add`` for a one-operand reduce over the last dim from its identity,
    its body combining its two arguments and returning that, else None."""
    if op is None or op.name != "stablehlo.reduce" or len(op.operands) != 2:
        return None
    rank = len(shape_of(op.operands[0]))
    if ints(op, "dimensions") != [rank - 1]:
        return None
    block = op.regions[0].blocks[0]
    body = list(block.operations)
    kinds = {"stablehlo.maximum": "max", "stablehlo.add": "add"}
    if len(body) != 2 or body[0].operation.name not in kinds:
        return None
    combine, ret = body[0].operation, body[1].operation
    args = [block.arguments[i] for i in range(len(block.arguments))]
    if len(args) != 2 or {str(v.get_name()) for v in combine.operands} != {
        str(a.get_name()) for a in args
    }:
        return None
    if ret.name != "stablehlo.return" or ret.operands[0] != combine.result:
        return None
    kind = kinds[combine.name]
    return kind if splat_value(op.operands[1], {}) == _INIT[kind] else None


def _rowwise(value: Any, reduce: Any) -> bool:
    """``value`` is ``reduce``'s result broadcast back over the last dim: in one
    broadcast (torch_xla), or first to a kept dim of 1 (a reshape or a broadcast) and
    then over it (the torch front-end). A row max may pass through ``max(-inf, m)``
    first (the torch front-end's ``amax``: the identity, NaN included)."""
    op = producer(value)
    rank = len(shape_of(value))
    if op is None or op.name != "stablehlo.broadcast_in_dim":
        return False
    src, dims = op.operands[0], ints(op, "broadcast_dimensions")
    if dims == list(range(rank)) and shape_of(src) == shape_of(value)[:-1] + [1]:
        keep = producer(src)
        if keep is None or not (
            keep.name == "stablehlo.reshape"
            or (
                keep.name == "stablehlo.broadcast_in_dim"
                and ints(keep, "broadcast_dimensions") == list(range(rank - 1))
            )
        ):
            return False
        src = keep.operands[0]
    elif dims != list(range(rank - 1)):
        return False
    if shape_of(src) != shape_of(value)[:-1]:
        return False
    if src == reduce.result:
        return True
    floor = producer(src)
    if floor is None or floor.name != "stablehlo.maximum" or _reduce_kind(reduce) != "max":
        return False
    a, b = floor.operands
    return (a == reduce.result and splat_value(b, {}) == _INIT["max"]) or (
        b == reduce.result and splat_value(a, {}) == _INIT["max"]
    )


def _in_type_of(dot: Any, like: Any) -> Any:
    """The operation whose result is ``dot``'s product in ``like``'s element type:
    ``dot`` itself, or the one convert that rounds its wider result to that type (the
    torch front-end writes a bf16 product float32-out, then converts), else None."""
    if element_type(dot.result) == element_type(like):
        return dot
    cv = only_user(dot.result, "stablehlo.convert")
    if cv is None or element_type(cv.result) != element_type(like):
        return None
    return cv if element_type(dot.result) in ("f32", "f64") else None


def _product_of(value: Any) -> Any:
    """The batched product that ``value`` is, possibly through the convert of its
    wider result (``_in_type_of``), else None."""
    op = producer(value)
    if op is not None and op.name == "stablehlo.convert" and not _batched_matmul(op):
        op = producer(op.operands[0])
    return op if _batched_matmul(op) else None


def _same_mask(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are one predicate: the same value, or broadcasts of one value
    the same way (an inlined ``where`` broadcasts its mask at each use)."""
    if a == b:
        return True
    pa, pb = producer(a), producer(b)
    return (
        pa is not None
        and pb is not None
        and pa.name == pb.name == "stablehlo.broadcast_in_dim"
        and pa.operands[0] == pb.operands[0]
        and ints(pa, "broadcast_dimensions") == ints(pb, "broadcast_dimensions")
        and shape_of(pa.result) == shape_of(pb.result)
    )


def _transpose_of(value: Any, src: Any) -> bool:
    """``value`` is ``src`` with its last two dims swapped."""
    op = producer(value)
    return (
        op is not None
        and op.name == "stablehlo.transpose"
        and op.operands[0] == src
        and ints(op, "permutation") == [0, 2, 1]
    )


def _scaling(x: Any) -> Any:
    """``x``'s one user if it is ``x * s`` or ``x / s`` (``s`` any value; checked by the
    caller), else None."""
    users = uses_of(x)
    if len(users) != 1 or users[0].name not in ("stablehlo.multiply", "stablehlo.divide"):
        return None
    return users[0] if users[0].operands[0] == x else None


def _scalar_source(value: Any) -> Any:
    """The scalar that ``value`` (a broadcast, possibly through converts) repeats."""
    src = source_of(value)
    return src if shape_of(src) == [] else None


# -------------------------------------------------------------------------- matching
def _row_max_of(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` reaches a max over its last dim (a softmax's first step) through
    reshapes, converts, scalings, masks and additions only: a product's result that
    does is attention's scores."""
    if depth > 6:
        return False
    for u in uses_of(value):
        if _reduce_kind(u) == "max":
            return True
        if u.name in _SCORE_PATH and _row_max_of(u.result, depth + 1):
            return True
    return False


_SCORE_PATH = frozenset(
    {
        "stablehlo.reshape",
        "stablehlo.convert",
        "stablehlo.multiply",
        "stablehlo.divide",
        "stablehlo.select",
        "stablehlo.add",
    }
)


def _forward(
    dot1: Any,
    scalars: dict[int, float],
    seen: dict[Any, tuple[str, tuple[int, ...]]],
    misses: list[str],
    state: StateValues,
    names: Mapping[int, str] | None = None,
) -> Site | None:
    """The forward pattern from the scores' product ``dot1``, or None; why, in ``misses``,
    where the product is attention's scores that the kernels cannot take."""
    q, kt = dot1.operands
    bh, t, d = shape_of(q)
    tk = shape_of(kt)[2]
    if tk != t and _row_max_of(dot1.result):
        misses.append(
            f"a cross-attention (queries of length {t}, keys of length {tk}): the fused "
            "kernels take self-attention only, queries and keys of one length"
        )
        return None
    if shape_of(kt) != [bh, d, t] or t < 2:
        return None
    scores = _in_type_of(dot1, q)
    if scores is None:
        return None
    rs = only_user(scores.result, "stablehlo.reshape")
    if rs is None or len(shape_of(rs.result)) != 4 or shape_of(rs.result)[2:] != [t, t]:
        return None
    b, h = shape_of(rs.result)[:2]
    mul = _scaling(skip_converts(rs.result))
    if mul is None:
        return None
    scale = _scalar_source(mul.operands[1])
    if scale is None:
        return None
    x = skip_converts(mul.result)
    causal = False
    sel = only_user(x, "stablehlo.select")
    inverted = False
    reads: tuple[int, ...] = ()
    if sel is not None:
        if sel.operands[1] != x and sel.operands[2] != x:
            return None
        inverted = sel.operands[2] == x  # masked_fill(cond, -inf): the fill where true
        fill = splat_value(sel.operands[1 if inverted else 2], scalars)
        if fill is None or not fill <= FILL_AT_MOST:
            return None
        miss, reads = mask_miss(sel, t, scalars, seen, state, inverted, names)
        if miss:
            misses.append(miss)
            return None
        causal = True
        x = skip_converts(sel.result)
    add = only_user(x, "stablehlo.add")
    if add is not None:  # an additive mask (Hugging Face's eager attention)
        miss, more = additive_miss(add, x, t, scalars, seen, state, names)
        if miss:
            misses.append(miss)
            return None
        causal, reads = True, tuple(sorted({*reads, *more}))
        x = skip_converts(add.result)
    users = uses_of(x)
    if len(users) != 2 or element_type(x) != "f32":
        return None
    mx = next((u for u in users if _reduce_kind(u) == "max"), None)
    sub = next((u for u in users if u.name == "stablehlo.subtract"), None)
    if mx is None or sub is None or sub.operands[0] != x or not _rowwise(sub.operands[1], mx):
        return None
    ex = only_user(sub.result, "stablehlo.exponential")
    if ex is None or len(uses_of(ex.result)) != 2:
        return None
    sm = next((u for u in uses_of(ex.result) if _reduce_kind(u) == "add"), None)
    div = next((u for u in uses_of(ex.result) if u.name == "stablehlo.divide"), None)
    if sm is None or div is None or div.operands[0] != ex.result:
        return None
    if not _rowwise(div.operands[1], sm):
        return None
    p32 = div.result
    to_bf = [u for u in uses_of(p32) if u.name in ("stablehlo.convert", "stablehlo.reshape")]
    if len(to_bf) != 1:
        return None
    rs2 = to_bf[0]
    if rs2.name == "stablehlo.convert":  # the probabilities rounded to q's type
        shaped = [u for u in uses_of(rs2.result) if u.name == "stablehlo.reshape"]
        rs2 = shaped[0] if len(shaped) == 1 else None
    if rs2 is None or shape_of(rs2.result) != [bh, t, t]:
        return None
    dot2 = next((u for u in uses_of(rs2.result) if _batched_matmul(u)), None)
    if dot2 is None or dot2.operands[0] != rs2.result or shape_of(dot2.operands[1]) != [bh, t, d]:
        return None
    out = _in_type_of(dot2, q)
    if out is None:
        return None
    if (
        b * h != bh
        or element_type(q) != element_type(kt)
        or element_type(q) != element_type(dot2.operands[1])
    ):
        return None
    v = dot2.operands[1]
    site = Site(b, h, t, d, element_type(q), element_type(scale), causal, q, kt, v, scale, out)
    site.divides = mul.name == "stablehlo.divide"
    site.fills_where_true, site.state_reads = inverted, reads
    site.probs, site.probs_product, site.mask_select = p32, rs2.result, sel
    return site


def _softmax_grad(p: Any, users: list[Any]) -> tuple[Any, Any] | None:
    """(dp, ds) where ``users`` (``p``'s two readers) compute the softmax's gradient
    ``ds`` from the probabilities ``p`` and their gradient ``dp``: as ``p * (dp -
    sum(dp * p))`` (torch_xla) or as ``dp * p - p * sum(dp * p)`` (torch's
    ``_softmax_backward_data``, the torch front-end), the sum over the last dim."""
    if len(users) != 2 or any(u.name != "stablehlo.multiply" for u in users):
        return None

    def other(m: Any) -> Any:
        return m.operands[0] if m.operands[1] == p else m.operands[1]

    for m1, m2 in ((users[0], users[1]), (users[1], users[0])):
        red = next((u for u in uses_of(m1.result) if _reduce_kind(u) == "add"), None)
        if red is None:
            continue
        dp, m1_users = other(m1), uses_of(m1.result)
        if len(m1_users) == 1:  # p * (dp - rowwise(sum))
            sub = producer(other(m2))
            if (
                sub is not None
                and sub.name == "stablehlo.subtract"
                and sub.operands[0] == dp
                and _rowwise(sub.operands[1], red)
            ):
                return dp, m2.result
        elif len(m1_users) == 2:  # dp * p - p * rowwise(sum)
            sub = next(u for u in m1_users if u != red)
            if (
                sub.name == "stablehlo.subtract"
                and sub.operands[0] == m1.result
                and sub.operands[1] == m2.result
                and _rowwise(other(m2), red)
            ):
                return dp, sub.result
    return None


def _backward(site: Site) -> bool:
    """Fill in ``site``'s backward; False when the probabilities have other readers."""
    p32, pb = site.probs, site.probs_product
    dot2 = site.out if _batched_matmul(site.out) else producer(site.out.operands[0])
    fwd_users = [u for u in uses_of(p32) if u.name in ("stablehlo.convert", "stablehlo.reshape")]
    others = [u for u in uses_of(p32) if u not in fwd_users]
    pb_others = [u for u in uses_of(pb) if u != dot2]
    p_grad = p32
    rounded = producer(pb).operands[0]  # the probabilities in q's type (or p32)
    if not others and rounded != p32:
        # The backward may read the rounded probabilities, widened again (torch's
        # softmax gradient of a bf16 softmax, as the torch front-end lowers it)
        back = [u for u in uses_of(rounded) if u != producer(pb)]
        if len(back) > 1 or (
            back
            and not (
                back[0].name == "stablehlo.convert"
                and element_type(back[0].result) == element_type(p32)
            )
        ):
            return False
        if back:
            p_grad = back[0].result
            others = uses_of(p_grad)
    if not others and not pb_others:
        return True  # no backward: an eval program
    # dv = dot(transpose(pb), do)
    if len(pb_others) != 1 or not _transpose_of(pb_others[0].result, pb):
        return False
    tr = pb_others[0]
    dv = only_user(tr.result, "stablehlo.dot_general")
    if dv is None or not _batched_matmul(dv) or dv.operands[0] != tr.result:
        return False
    dv_out = _in_type_of(dv, site.q)
    do = dv.operands[1]
    # the softmax gradient
    grad = _softmax_grad(p_grad, others)
    if grad is None or dv_out is None:
        return False
    dp32, ds = grad
    dp = source_of(dp32)
    rs = producer(dp)
    if rs is None or rs.name != "stablehlo.reshape":
        return False
    dpdot = _product_of(rs.operands[0])
    if dpdot is None or dpdot.operands[0] != do:
        return False
    if not _transpose_of(dpdot.operands[1], site.v):
        return False
    # the mask's zeros and the scale, then ds's two products
    x = skip_converts(ds)
    if site.mask_select is not None:
        sel = only_user(x, "stablehlo.select")
        fwd_sel = site.mask_select
        x_at, zero_at = (2, 1) if site.fills_where_true else (1, 2)
        if sel is None or not _same_mask(sel.operands[0], fwd_sel.operands[0]):
            return False
        if sel.operands[x_at] != x:
            return False
        if splat_value(sel.operands[zero_at], {}) != 0.0:
            return False
        x = skip_converts(sel.result)
    mul = _scaling(x)
    if mul is None or (mul.name == "stablehlo.divide") != site.divides:
        return False
    if _scalar_source(mul.operands[1]) != site.scale:
        return False
    rs2 = only_user(skip_converts(mul.result), "stablehlo.reshape")
    if rs2 is None:
        return False
    ds_users = uses_of(rs2.result)
    dq = next((u for u in ds_users if _batched_matmul(u) and u.operands[0] == rs2.result), None)
    dkt = next((u for u in ds_users if _batched_matmul(u) and u.operands[1] == rs2.result), None)
    if len(ds_users) != 2 or dq is None or dkt is None:
        return False
    if not (_transpose_of(dq.operands[1], site.kt) and _transpose_of(dkt.operands[0], site.q)):
        return False
    dq_out, dkt_out = _in_type_of(dq, site.q), _in_type_of(dkt, site.q)
    if dq_out is None or dkt_out is None:
        return False
    dq, dkt, dv = dq_out, dkt_out, dv_out
    # The backward call goes before the first of the three products: it must come after
    # the forward (whose residuals it reads) and after ``do``, in the same block.
    order = {o.operation: i for i, o in enumerate(site.out.block.operations)}
    if any(g not in order for g in (dq, dkt, dv)):
        return False
    first = min((dq, dkt, dv), key=order.__getitem__)
    do_op = producer(do)
    if order[site.out] > order[first] or (do_op in order and order[do_op] > order[first]):
        return False
    site.do, site.dq, site.dkt, site.dv = do, dq, dkt, dv
    site.first_grad = first
    return True


def _in_composite_decompositions(module: Module) -> set[Any]:
    """The operations of the functions that attention composites name as their
    decomposition."""
    from .attention_composite import find_composites

    names = set()
    for op, _ in find_composites(module):
        names.add(str(op.attributes["decomposition"]).lstrip("@").strip('"'))
    inside: set[Any] = set()
    if not names:
        return inside
    for op in module._operations():
        if op.name == "func.func" and str(op.attributes["sym_name"]).strip('"') in names:
            stack = [op]
            while stack:
                o = stack.pop()
                inside.add(o)
                for region in o.regions:
                    for block in region.blocks:
                        stack.extend(child.operation for child in block.operations)
    return inside


def count_score_products(module: Module) -> int:
    """How many batched products make a (n, T, T) result with T >= 128 (attention's
    scores, and in a backward the probabilities' gradient): two per training attention,
    what ``find_attention`` should account for. Those of an attention composite's
    decomposition (``attention_composite.py``, accounted for there) are not counted."""
    with module._ctx:
        inside = _in_composite_decompositions(module)
        return sum(
            1
            for op in module._operations()
            if _batched_matmul(op)
            and op not in inside
            and shape_of(op.result)[1] == shape_of(op.result)[2] >= 128
            and shape_of(op.operands[0])[2] < shape_of(op.result)[2]
        )


def find_attention(
    module: Module,
    scalars: dict[int, float] | None = None,
    misses: list[str] | None = None,
    state: StateValues | None = None,
    names: Mapping[int, str] | None = None,
) -> list[Site]:
    """Every attention of ``module``'s functions that matches the pattern (module
    docstring) with its backward complete or absent. ``scalars`` gives @main's scalar
    constant arguments (argument number -> value), where the mask's fill may come from.
    ``misses``, when given, gets a reason for each attention seen and not taken that
    has one: a cross-attention, a mask not provably causal. ``state``: the state
    arguments a mask may be computed from (``StateValues``); ``names``: what @main's
    other arguments are (argument number -> "the batch input 'x'"), for the reasons."""
    found = []
    seen: dict[Any, tuple[str, tuple[int, ...]]] = {}
    why: list[str] = [] if misses is None else misses
    inline_private_calls(module)
    with module._ctx:
        for op in module._operations():
            if not _batched_matmul(op):
                continue
            site = _forward(op, scalars or {}, seen, why, state or {}, names)
            if site is not None and _backward(site):
                found.append(site)
    return found
