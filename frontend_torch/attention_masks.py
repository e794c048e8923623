"""A causal ``attn_mask`` computed from constants, turned into ``is_causal=True``.

Hugging Face's models build their causal mask in ``forward`` (from ``arange`` and
comparisons) and pass it to ``F.scaled_dot_product_attention`` as ``attn_mask``
whenever they believe they are traced, as they are under this front-end's capture;
PyTorch turns a boolean mask into an additive one (0 kept, -inf masked) before its CPU
kernel. A mask that is a function of no graph input is computed here, with torch, when
the step is lowered; where it is the causal triangle (PyTorch's ``is_causal``: top-left,
every batch and head), the attention node is given ``is_causal=True`` and no mask, the
form a TPU runtime swaps for fused kernels (``stablehlo/attention_composite.py``). The
results are the same: a kept score plus 0 is the score, and a masked one gets zero
probability either way (a causal row always keeps its diagonal).

Imports: torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["FILL_AT_MOST", "fold_causal_masks"]

aten = torch.ops.aten

FILL_AT_MOST = -1e30
"""An additive mask's masked entries must be at most this (-inf, or a dtype's minimum)."""

# attention node -> the position of its is_causal argument
_IS_CAUSAL_AT = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: 4,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 7,
}
_MAX_ELEMENTS = 1 << 26
"""A larger mask is not computed (its memory, at export)."""


def _constant_value(node: fx.Node, gm: fx.GraphModule) -> torch.Tensor | None:
    """``node``'s value when it depends on no graph input, computed with torch."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" or n.op not in ("call_function", "get_attr"):
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    env: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for n in sorted(order, key=_position(gm)):
            if n.op == "get_attr":
                env[n] = getattr(gm, str(n.target))
                continue
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
            env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
    value = env[node]
    return value if isinstance(value, torch.Tensor) else None


def _position(gm: fx.GraphModule) -> Any:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return index.__getitem__


def _is_causal(mask: torch.Tensor, tq: int, tk: int) -> bool:
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (tq, tk):
        return False
    keep = torch.ones(tq, tk, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == keep).all())
    if not mask.is_floating_point():
        return False
    m = mask.double()
    return bool((m.masked_fill(~keep, 0.0) == 0).all()) and bool(
        (m.masked_fill(keep, FILL_AT_MOST) <= FILL_AT_MOST).all()
    )


def fold_causal_masks(gm: fx.GraphModule) -> int:
    """Give every attention whose ``attn_mask`` is a causal constant ``is_causal=True``
    and no mask, in place; returns how many."""
    folded = 0
    known: dict[fx.Node, bool] = {}
    for node in list(gm.graph.nodes):
        at = _IS_CAUSAL_AT.get(node.target) if node.op == "call_function" else None
        mask = node.kwargs.get("attn_mask") if at is not None else None
        if at is None or not isinstance(mask, fx.Node):
            continue
        if mask not in known:
            q = node.args[1 if at == 7 else 0]
            k = node.args[2 if at == 7 else 1]
            tq, tk = (int(a.meta["val"].shape[-2]) for a in (q, k))
            numel = mask.meta["val"].numel() if "val" in mask.meta else _MAX_ELEMENTS + 1
            value = _constant_value(mask, gm) if numel <= _MAX_ELEMENTS else None
            known[mask] = value is not None and _is_causal(value, tq, tk)
        if not known[mask]:
            continue
        args = list(node.args)
        if len(args) == 3:  # the forward's dropout_p left at its default
            args.append(0.0)
        node.args = (*args[:at], True, *args[at + 1 :])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
        folded += 1
    if folded:  # the mask's nodes stay (unused: XLA drops them; no random key moves)
        gm.recompile()
    return folded
