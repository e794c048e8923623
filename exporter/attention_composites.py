"""``F.scaled_dot_product_attention`` traced as the attention composites.

Within ``sdpa_composites()`` (the tracer's steps run in it), every
``F.scaled_dot_product_attention`` the step calls is computed by ``_Attention``, whose
forward and backward torch_xla writes as the ``stablehlo.composite`` operations
``stepbundle.attention`` (q, k, v[, mask]) -> (out, lse) and
``stepbundle.attention_grad`` (dout, q, k, v, out, lse[, mask]) -> (dq, dk, dv), version 1,
with the attributes the torch front-end writes (``stablehlo/attention_composite.py``):
the runtime treats both front-ends' bundles alike (a TPU swaps in the splash kernels; a
runtime that does not know the names runs the decompositions).

The decompositions are the math written here: the products and the softmax in float32
for half-precision inputs (PyTorch's math kernel does the same), the results rounded
once to q's dtype; the backward is flash attention's (the probabilities rebuilt from
the forward's logsumexp, the softmax gradient's row sums from ``dout * out``), so it
reads both forward results, as a kernel may. Python numbers inside become constants
of the decomposition (``xla.numbers_as_constants``), so a composite's operands are
exactly those above.

Kept as PyTorch computes it, with no composite (the runtime's pattern matcher or the
decomposition-free trace then applies): dropout on the probabilities (p > 0), both a
mask and ``is_causal``, inputs of another rank than 4, an additive mask that requires a
gradient, and a step traced with ``COMPOSITES`` False.

Imports: torch; torch_xla through ``xla.py``; stepbundle.stablehlo.attention_composite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from stepbundle.stablehlo import attention_composite as ac

from . import xla
from .modes import call_arguments

__all__ = ["COMPOSITES", "MARKS", "sdpa_composites"]

COMPOSITES = True
"""Write each SDPA as the composites; False leaves ``F.scaled_dot_product_attention``
to torch_xla (the tests compare the two)."""

MARKS = True
"""False traces the same math without marking it as composites (the tests compare the
decomposition with it bit for bit)."""


def _mark(
    tensors: Sequence[torch.Tensor],
    name: str,
    instance: str,
    is_input: bool,
    attributes: Mapping[str, bool | int | float | str] | None = None,
) -> list[torch.Tensor]:
    if not MARKS:
        return list(tensors)
    return xla.mark_composite(tensors, name, instance, is_input, attributes)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


@dataclass(frozen=True)
class _Spec:
    """One SDPA call's attributes, and its composites' instance ids."""

    causal: bool
    scale: float
    mask: str
    groups: int
    q_len: int
    kv_len: int
    instance: str

    def attributes(self) -> dict[str, bool | int | float | str]:
        attrs: dict[str, bool | int | float | str] = ac.attributes(
            causal=self.causal,
            scale=self.scale,
            mask=self.mask,
            dropout_p=0.0,
            groups=self.groups,
            q_len=self.q_len,
            kv_len=self.kv_len,
        )
        return attrs


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, spec: _Spec) -> Any:
    """The scaled, masked scores (B, H, Tq, Tk) in q's (compute) dtype; k's heads
    already repeated."""
    s = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    if spec.causal:
        keep = torch.ones(spec.q_len, spec.kv_len, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    return s


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _unrepeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_repeat``: each key/value head's share summed."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x.reshape(b, h // groups, groups, t, d).sum(2)


class _Attention(torch.autograd.Function):
    """SDPA whose forward and backward are each marked as one composite."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        spec: _Spec,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        operands = [q, k, v] + ([] if mask is None else [mask])
        with _region(q.device.type):
            marked = _mark(operands, ac.NAME, spec.instance, is_input=True)
            mq, mk, mv = marked[:3]
            m = marked[3] if mask is not None else None
            dt = _compute_dtype(q.dtype)
            k32 = _repeat(mk.to(dt), spec.groups)
            v32 = _repeat(mv.to(dt), spec.groups)
            s = _scores(mq.to(dt), k32, m, spec)
            lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse.unsqueeze(-1))
            out = torch.matmul(p, v32).to(q.dtype)
            out, lse = _mark(
                [out, lse.to(torch.float32)],
                ac.NAME,
                spec.instance,
                is_input=False,
                attributes=spec.attributes(),
            )
        ctx.spec = spec
        ctx.has_mask = mask is not None
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        spec: _Spec = ctx.spec
        saved = list(ctx.saved_tensors)
        q, k, v, out, lse = saved[:5]
        mask = saved[5] if ctx.has_mask else None
        operands = [dout, q, k, v, out, lse] + ([] if mask is None else [mask])
        grad_id = spec.instance + "-grad"
        with _region(q.device.type):
            marked = _mark(operands, ac.GRAD_NAME, grad_id, is_input=True)
            mdo, mq, mk, mv, mout, mlse = marked[:6]
            m = marked[6] if mask is not None else None
            dt = _compute_dtype(q.dtype)
            q32, do32 = mq.to(dt), mdo.to(dt)
            k32 = _repeat(mk.to(dt), spec.groups)
            v32 = _repeat(mv.to(dt), spec.groups)
            p = torch.exp(_scores(q32, k32, m, spec) - mlse.to(dt).unsqueeze(-1))
            dv = torch.matmul(p.transpose(-1, -2), do32)
            dp = torch.matmul(do32, v32.transpose(-1, -2))
            delta = (do32 * mout.to(dt)).sum(dim=-1, keepdim=True)
            ds = p * (dp - delta) * spec.scale
            dq = torch.matmul(ds, k32)
            dk = torch.matmul(ds.transpose(-1, -2), q32)
            grads = [
                dq.to(q.dtype),
                _unrepeat(dk, spec.groups).to(k.dtype),
                _unrepeat(dv, spec.groups).to(v.dtype),
            ]
            dq, dk, dv = _mark(
                grads, ac.GRAD_NAME, grad_id, is_input=False, attributes=spec.attributes()
            )
        return dq, dk, dv, None, None


class _region:  # noqa: N801 - a context manager, used like a function
    """The ops of one decomposition: numbers as constants, autocast off (the dtypes are
    the ones written above), no autograd recording (the backward is written out)."""

    def __init__(self, device_type: str) -> None:
        self._device_type = device_type
        self._stack: list[Any] = []

    def __enter__(self) -> None:
        for cm in (
            xla.numbers_as_constants(),
            torch.autocast(self._device_type, enabled=False),
            torch.no_grad(),
        ):
            cm.__enter__()
            self._stack.append(cm)

    def __exit__(self, *exc: Any) -> None:
        while self._stack:
            self._stack.pop().__exit__(*exc)


def _spec(a: Mapping[str, Any], instance: str) -> _Spec | None:
    """The call's attributes, or None when it is kept as PyTorch computes it (module
    docstring)."""
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        return None
    if q.device.type != "xla" or a["dropout_p"] or (mask is not None and a["is_causal"]):
        return None
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.requires_grad):
        return None
    h, hk = int(q.shape[1]), int(k.shape[1])
    if hk != int(v.shape[1]) or h % hk or (h != hk and not a["enable_gqa"]):
        return None
    scale = a["scale"]
    kind = "none" if mask is None else ("boolean" if mask.dtype == torch.bool else "additive")
    if a["is_causal"]:
        kind = "causal"
    return _Spec(
        causal=bool(a["is_causal"]),
        scale=float(1.0 / math.sqrt(int(q.shape[-1])) if scale is None else scale),
        mask=kind,
        groups=h // hk,
        q_len=int(q.shape[2]),
        kv_len=int(k.shape[2]),
        instance=instance,
    )


class sdpa_composites(TorchFunctionMode):  # noqa: N801 - used as a context manager
    """Within it, ``F.scaled_dot_product_attention`` on XLA tensors is traced as the
    attention composites (module docstring). Instance ids count the calls from 0, so two
    traces of one step give one graph."""

    def __init__(self) -> None:
        super().__init__()
        self._calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if COMPOSITES and func is torch.nn.functional.scaled_dot_product_attention:
            a = call_arguments(_SDPA_ARGS, _SDPA_DEFAULTS, args, kwargs)
            spec = _spec(a, f"stepbundle-sdpa-{self._calls}")
            if spec is not None:
                self._calls += 1
                out, _ = _Attention.apply(  # type: ignore[no-untyped-call]
                    a["query"], a["key"], a["value"], a["attn_mask"], spec
                )
                return out
        return func(*args, **kwargs)
