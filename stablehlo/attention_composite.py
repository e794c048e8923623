"""Attention written into a program as a named operation, and swapped for fused kernels.

Where a front-end sees attention as one operation (``F.scaled_dot_product_attention``),
it writes a ``stablehlo.composite`` named ``stepbundle.attention`` whose decomposition
is the math it traced, and one named ``stepbundle.attention_grad`` for its backward.
A runtime that does not know the names runs the decompositions (XLA inlines a
composite); a TPU runtime calls fused kernels instead where the attributes allow
(``rewrite_composites``). Both are version 1:

    stepbundle.attention       (q, k, v[, mask]) -> (out, lse)
    stepbundle.attention_grad  (dout, q, k, v, out, lse[, mask]) -> (dq, dk, dv)

q is (B, H, Tq, D), k and v (B, H / groups, Tk, D) (v's last dim may differ), out is
q's dtype, lse (B, H, Tq) float32: the rows' logsumexp of the scaled, masked scores. A
forward whose lse nothing reads may return ``out`` alone (torch_xla drops a composite
result its graph never reaches: an eval program's); a reader takes both forms.
The mask operand is there when ``mask`` is ``boolean`` (True keeps a score) or
``additive`` (added to the scores); it broadcasts to (B, H, Tq, Tk). Attributes
(``composite_attributes``): ``causal`` (bool: the upper triangle of (Tq, Tk), aligned
top-left as PyTorch's ``is_causal``, is masked), ``scale`` (float), ``mask`` ("none",
"causal", "boolean", "additive"), ``dropout_p`` (float; 0 unless a front-end writes
dropout inside), ``groups`` (int: query heads per key/value head), ``q_len``,
``kv_len`` (ints).

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir

from stepbundle.schema.errors import UsageError

from .artifact import Module
from .attention_masks import FILL_AT_MOST
from .build import verify
from .graph import (
    StateValues,
    call,
    element_type,
    function_type,
    insert_functions,
    shape_of,
)
from .mask_values import compute_mask, is_causal

__all__ = [
    "GRAD_NAME",
    "MASK_KINDS",
    "NAME",
    "VERSION",
    "Attention",
    "attributes",
    "causal_mask_reads",
    "count_composites",
    "find_composites",
    "rewrite_composites",
    "stamp_version",
]

NAME = "stepbundle.attention"
GRAD_NAME = "stepbundle.attention_grad"
VERSION = 1
MASK_KINDS = ("none", "causal", "boolean", "additive")


def attributes(
    *, causal: bool, scale: float, mask: str, dropout_p: float, groups: int, q_len: int, kv_len: int
) -> dict[str, Any]:
    """The composite's attributes, as a front-end writes them (``jax.lax.composite``'s
    keyword arguments)."""
    if mask not in MASK_KINDS:
        raise UsageError(f"mask kind {mask!r} is not one of {MASK_KINDS}")
    return {
        "causal": bool(causal),
        "scale": float(scale),
        "mask": mask,
        "dropout_p": float(dropout_p),
        "groups": int(groups),
        "q_len": int(q_len),
        "kv_len": int(kv_len),
    }


@dataclass(frozen=True)
class Attention:
    """One attention composite's attributes and shapes: what its kernels depend on.

    Attributes:
      grad: a ``stepbundle.attention_grad`` (else the forward).
      batch, heads, kv_heads, q_len, kv_len, head_dim, v_dim: B, H, H / groups, Tq, Tk,
        D, and v's last dim.
      dtype: q's element type as MLIR prints it (``bf16``).
      causal, scale, mask, dropout_p, groups: the composite's attributes.
      version: the composite's version.
      k_dtype, v_dtype: k's and v's element types where they are not q's ("" where they
        are): torch_xla's Hugging Face Llama under autocast gives float32 q and k (after
        the rotary embedding) and a bf16 v.
    """

    grad: bool
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_dim: int
    dtype: str
    causal: bool
    scale: float
    mask: str
    dropout_p: float
    groups: int
    version: int
    k_dtype: str = ""
    v_dtype: str = ""

    def dtypes(self) -> tuple[str, str, str]:
        """q's, k's and v's element types."""
        return self.dtype, self.k_dtype or self.dtype, self.v_dtype or self.dtype

    def describe(self) -> str:
        """The site in words (for a message)."""
        what = "attention backward" if self.grad else "attention"
        mask = "causal" if self.causal else self.mask
        q, k, v = self.dtypes()
        types = q if q == k == v else f"q {q}, k {k}, v {v}"
        return (
            f"{what} (batch {self.batch}, {self.heads} heads of {self.head_dim}, "
            f"{self.kv_heads} key/value heads, Tq {self.q_len}, Tk {self.kv_len}, "
            f"{types}, mask {mask}, dropout {self.dropout_p:g})"
        )


def _attr_value(attr: Any) -> Any:
    for kind in (ir.BoolAttr, ir.IntegerAttr, ir.FloatAttr, ir.StringAttr):
        try:
            return kind(attr).value
        except (ValueError, TypeError):  # not of this kind
            continue
    return None


def _read(op: Any) -> Attention | None:
    """``op``'s attention, or None when it is not one of ours in a form we read."""
    if op.name != "stablehlo.composite":
        return None
    name = ir.StringAttr(op.attributes["name"]).value
    if name not in (NAME, GRAD_NAME):
        return None
    version = ir.IntegerAttr(op.attributes["version"]).value if "version" in op.attributes else 0
    attrs: dict[str, Any] = {}
    if "composite_attributes" in op.attributes:
        table = ir.DictAttr(op.attributes["composite_attributes"])
        for key in ("causal", "scale", "mask", "dropout_p", "groups", "q_len", "kv_len"):
            if key in table:
                attrs[key] = _attr_value(table[key])
    grad = name == GRAD_NAME
    qkv = list(op.operands)[1:4] if grad else list(op.operands)[:3]
    if len(qkv) != 3 or any(len(shape_of(v)) != 4 for v in qkv):
        return None
    (b, h, tq, d), (_, hk, tk, _), v_dim = shape_of(qkv[0]), shape_of(qkv[1]), shape_of(qkv[2])[3]
    tq_, tk_, tv_ = (element_type(x) for x in qkv)
    try:
        return Attention(
            grad, b, h, hk, tq, tk, d, v_dim, tq_,
            bool(attrs["causal"]), float(attrs["scale"]), str(attrs["mask"]),
            float(attrs["dropout_p"]), int(attrs["groups"]), int(version),
            "" if tk_ == tq_ else tk_, "" if tv_ == tq_ else tv_,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return None


def find_composites(module: Module) -> list[tuple[Any, Attention | None]]:
    """Every attention composite of ``module`` (forward and backward), with its reading
    (None where the attributes are not the version-1 set)."""
    with module._ctx:
        found = []
        for op in module._operations():
            if op.name != "stablehlo.composite":
                continue
            if ir.StringAttr(op.attributes["name"]).value in (NAME, GRAD_NAME):
                found.append((op, _read(op)))
        return found


def stamp_version(module: Module) -> int:
    """Give every attention composite without a version this format's (torch_xla's
    composite builder writes none), in place; returns how many."""
    stamped = 0
    with module._ctx:
        for op, _ in find_composites(module):
            if "version" not in op.attributes:
                op.attributes["version"] = ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(32), VERSION
                )
                stamped += 1
    return stamped


def count_composites(module: Module) -> int:
    """How many attention composites ``module`` holds (forward and backward)."""
    return len(find_composites(module))


def causal_mask_reads(
    mask: Any,
    att: Attention,
    scalars: Mapping[int, float],
    state: StateValues,
    names: Mapping[int, str] | None = None,
) -> tuple[tuple[int, ...] | None, str]:
    """The state arguments read, when the composite's ``mask`` operand computes (when
    the program is compiled, ``mask_values.compute_mask``) to PyTorch's ``is_causal`` for
    every batch row and head it holds: the top-left lower triangle of (Tq, Tk), True where
    kept for a boolean mask, 0 there and at most ``FILL_AT_MOST`` elsewhere for an
    additive one; and "". None and why in words when it does not, or cannot be computed
    (read from the step's inputs, named by ``names``; larger than the load computes)."""
    tq, tk = att.q_len, att.kv_len
    if shape_of(mask)[-2:] != [tq, tk]:
        shape = tuple(shape_of(mask))
        return None, (
            f"the mask is {shape}, not one ({tq}, {tk}) slice of the scores per batch row "
            "and head (a key-padding mask is broadcast over the queries)"
        )
    computed = compute_mask(mask, scalars, state, names)
    if computed.values is None:
        return None, computed.why
    if element_type(mask) == "i1":
        causal = is_causal(computed.values, bool, lambda v: not v)
    else:
        causal = is_causal(computed.values, lambda v: v == 0.0, lambda v: v <= FILL_AT_MOST)
    if not causal:
        loaded = ", ".join(state[num][0] for num in computed.reads)
        where = f" (from the loaded value of {loaded})" if loaded else ""
        return None, f"computed{where}, it is not the causal triangle"
    return computed.reads, ""


Kernels = Callable[[Attention], str]
"""Attention -> the text of a module whose ``@main`` takes the composite's operands
and returns its results."""


def rewrite_composites(
    module: Module,
    kernels: Kernels,
    supported: Callable[[Attention], str | None],
    scalars: Mapping[int, float] | None = None,
    state: StateValues | None = None,
    state_reads: set[int] | None = None,
    names: Mapping[int, str] | None = None,
) -> tuple[list[Attention], list[str]]:
    """Replace each attention composite that ``supported`` takes (returns None for) by
    a call of the function ``kernels`` gives, in place; the rest keep their
    decomposition. Returns those replaced and, for each kept, why in words.

    A boolean or additive mask that computes to the causal triangle
    (``causal_mask_reads``: from constants, ``scalars`` (@main's scalar constant
    arguments) and ``state`` (buffers the step never writes, as loaded)) is read as
    ``is_causal``: the kernels get no mask (Hugging Face's SDPA path, through torch_xla,
    passes its causal mask so). ``state_reads`` gets the state arguments the replaced
    composites' masks were computed from (the program assumes them: the caller must
    hold the state to them).

    A composite whose kernel function does not take and give its types is kept, with
    that reason (the other sites are still replaced).

    Raises:
      ValueError: the module does not verify afterwards (it may be partly rewritten: the
        runtime rewrites a copy).
    """
    replaced: list[Attention] = []
    kept: list[str] = []
    masks: dict[Any, tuple[tuple[int, ...] | None, str]] = {}
    with module._ctx:
        made: dict[Attention, str] = {}
        for op, att in find_composites(module):
            if att is None:
                kept.append("an attention composite whose attributes this runtime cannot read")
                continue
            if att.version != VERSION:
                kept.append(f"{att.describe()}: composite version {att.version}, not {VERSION}")
                continue
            operands = list(op.operands)
            reads: tuple[int, ...] = ()
            at = 6 if att.grad else 3  # the mask operand (module docstring)
            folded = ""  # why a mask was not read as is_causal
            if att.mask in ("boolean", "additive") and not att.causal and len(operands) > at:
                if operands[at] not in masks:  # a forward and its backward share one
                    masks[operands[at]] = causal_mask_reads(
                        operands[at], att, scalars or {}, state or {}, names
                    )
                causal, folded = masks[operands[at]]
                if causal is not None:
                    att = dataclasses.replace(att, causal=True, mask="causal")
                    operands, reads = operands[:at], causal
            why = supported(att)
            if why is not None and folded and not att.dropout_p:
                why = (
                    f"{'an' if att.mask == 'additive' else 'a'} {att.mask} attn_mask that is "
                    f"not the causal triangle is not fused: {folded}; if the attention is "
                    "causal, pass is_causal=True and no mask"
                )
            if why is not None:
                kept.append(f"{att.describe()}: {why}")
                continue
            if att not in made:
                kind = "bwd" if att.grad else "fwd"
                made[att] = insert_functions(
                    module, kernels(att), f"stepbundle_sdpa{len(made)}_{kind}"
                )
            ft = function_type(module, made[att])
            want_in = [str(v.type) for v in operands]
            want_out = [str(r.type) for r in op.results]
            got_in, got_out = [str(t) for t in ft.inputs], [str(t) for t in ft.results]
            # A forward whose lse no one reads may give ``out`` alone (module docstring)
            if got_in != want_in or got_out[: len(want_out)] != want_out or not want_out:
                # this site only: the others of the program are still fused
                kept.append(
                    f"{att.describe()}: the kernels' function takes {got_in} -> {got_out}, "
                    f"the composite {want_in} -> {want_out} (a stepbundle bug: please "
                    "report it with this line)"
                )
                continue
            new = call(module, made[att], operands, op)
            for result, value in zip(op.results, new):
                result.replace_all_uses_with(value)
            op.erase()
            replaced.append(att)
            if state_reads is not None:
                state_reads.update(reads)
        if replaced:
            verify(module._module, "fusing attention composites")
    return replaced, kept
