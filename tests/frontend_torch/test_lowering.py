"""Each aten lowering against torch itself: the same function, run by torch and by jax.

A small torch function (forward, and backward through autograd where it has one) is
captured the way the front-end captures a step (make_fx, functionalized, decomposed to
core aten), then evaluated by the front-end's jax lowering; torch's own eager result is
the oracle. Floats agree to a few ulp (rtol 2e-5), integers and booleans exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from stepbundle.export_torch.capture import DECOMPOSITIONS, DURING_STEP
from stepbundle.export_torch.lowering import (
    ProgramGraph,
    UnsupportedOperator,
    evaluate,
    lower,
)
from stepbundle.stablehlo.artifact import parse_artifact
from stepbundle.stablehlo.onehot import count_onehot_reductions


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def traced(fn: Callable[..., list[torch.Tensor]], *args: torch.Tensor) -> ProgramGraph:
    """``fn``'s graph as the front-end captures a step (functionalized, decomposed), every
    argument an input and every result an output."""
    first = make_fx(fn, tracing_mode="fake", decomposition_table=DURING_STEP)(*args)
    gm = make_fx(
        torch.func.functionalize(first, remove="mutations_and_views"),
        tracing_mode="fake",
        decomposition_table=DECOMPOSITIONS,
    )(*args)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return ProgramGraph(gm, tuple(range(len(args))), tuple(out.args[0]), seeded=False)


def lowered(fn: Callable[..., list[torch.Tensor]], *args: torch.Tensor) -> list[np.ndarray]:
    """``fn(*args)`` computed by the front-end's lowering (jax, eagerly)."""
    graph = traced(fn, *args)
    with jax.enable_x64(True):
        inputs = [
            jnp.asarray(a.detach().float().numpy(), jnp.bfloat16)
            if a.dtype == torch.bfloat16
            else jnp.asarray(a.detach().numpy())
            for a in args
        ]
        # One compiled program (jax would otherwise compile every operator on its own).
        results = jax.jit(lambda *xs: evaluate(graph, xs, None))(*inputs)
        return [
            np.asarray(jnp.asarray(v, jnp.float32) if v.dtype == jnp.bfloat16 else v)
            for v in results
        ]


def check(fn: Callable[..., list[torch.Tensor]], *args: torch.Tensor, rtol: float = 2e-5) -> None:
    want = [_numpy(t) for t in fn(*[a.clone() for a in args])]
    got = lowered(fn, *args)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        if w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w, err_msg=f"output {i}")
        else:
            scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 1e-6)
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale, err_msg=f"output {i}")


g = torch.Generator().manual_seed(0)


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def grads(loss: torch.Tensor, *wrt: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, wrt))


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


CASES: dict[str, tuple[Callable[..., Any], tuple[torch.Tensor, ...]]] = {
    "elementwise and promotion": (
        lambda x, i: [
            x * 2.5 - 1,
            i * 0.5,
            i / 3,
            torch.div(i, 3, rounding_mode="floor"),
            torch.div(-i, 3, rounding_mode="trunc"),
            torch.remainder(-i, 3),
            x.abs().sqrt(),
            x.abs().rsqrt(),
            x.pow(2),
            x.abs().pow(0.5),
            x.abs().pow(1.7),
            torch.exp(x),
            torch.log1p(x.abs()),
            torch.tanh(x),
            torch.sigmoid(x),
            torch.erf(x),
            F.gelu(x),
            F.gelu(x, approximate="tanh"),
            F.silu(x),
            torch.relu(x),
            x.clamp(-0.5, 0.5),
            torch.where(x > 0, x, i.float()),
            (x > 0) & (i > 2),
            ~(i > 2),
            x.sign(),
            x.floor(),
            (x * 3).round(),
            torch.maximum(x, -x.flip(0)),
        ],
        (rand(6, 4), torch.arange(24).reshape(6, 4) - 5),
    ),
    "reductions": (
        lambda x, t: [
            x.sum(1, keepdim=True),
            x.mean(),
            x.amax(0),
            t.argmax(1),  # ties: the first one, as torch
            (x > 1).any(1),
            *torch.var_mean(x, dim=0),
            x.var(1, unbiased=False),
            x.std(),
            x.cumsum(1),
            F.softmax(x, -1),
            F.log_softmax(x, 0),
            torch.logsumexp(x, 1),
            x.max(1).values,
            x.max(1).indices,
        ],
        (rand(5, 7), torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])),
    ),
    "matrices": (
        lambda a, b, c, w: [
            a @ b,
            torch.bmm(c, c.transpose(1, 2)),
            F.linear(a, w, torch.ones(3)),
            torch.einsum("bij,bkj->bik", c, c),
        ],
        (rand(4, 5), rand(5, 3), rand(2, 3, 4), rand(3, 5)),
    ),
    "shapes": (
        lambda x: [
            x.view(4, 6).permute(1, 0).contiguous(),
            x[None].expand(2, 2, 3, 4),
            torch.cat([x, x * 2], 1),
            torch.stack([x, -x], 0),
            *x.split([1, 2], 1),
            x[:, ::2, -3:],
            x[1],
            F.pad(x, (1, 2, 0, 1), value=-1.0),
            F.pad(x, (-1, 0)),
            x.flip(2),
            x.roll(1, 1),
            torch.tril(x[0]),
            x.squeeze(0).unsqueeze(-1),
            *x.unbind(1),
        ],
        (rand(2, 3, 4),),
    ),
    "indexing": (
        lambda x, idx, src: [
            x[idx],
            x[:, idx[:2]],
            x.index_put((idx,), torch.ones(3, 4), accumulate=True),
            torch.gather(x, 1, idx[:2].reshape(1, 2).expand(5, 2)),
            # one position per row (nll_loss's forward): lowered as a reduction
            torch.gather(x[:3], 1, idx.reshape(3, 1)),
            torch.gather(x[:, :3], 0, idx.reshape(1, 3) % 5),
            torch.gather(x[:3].long(), 1, idx.reshape(3, 1)),
            torch.zeros(5, 4).scatter(0, idx.reshape(3, 1).expand(3, 4), src),
            torch.zeros(5, 4).scatter_add(0, idx.reshape(3, 1).expand(3, 4), src),
            # one position per row (nll_loss's backward): lowered as a comparison
            torch.zeros(3, 4).scatter(1, idx.reshape(3, 1), -1.0),
            x[:3].scatter(1, idx.reshape(3, 1), src[:, :1]),
            x[:, :3].scatter(0, idx.reshape(1, 3) % 5, src[:1, :3]),
            x.index_select(0, idx),
        ],
        (rand(5, 4), torch.tensor([3, 0, 3]), rand(3, 4)),
    ),
    "diagonals": (
        lambda x, d, e, f: [
            x.diagonal(),
            x.diagonal(1, 1, 2),
            x.diagonal(-1, -1, 0),
            torch.diagonal_scatter(x, d, 0, 1, 2),
            torch.diagonal_scatter(x, e, 1, 1, 2),
            torch.diagonal_scatter(x, f, -2, 2, 0),
        ],
        (rand(3, 4, 4), rand(3, 4), rand(3, 3), rand(4, 2)),
    ),
    "creation": (
        lambda x: [
            torch.arange(5) * x.sum(),
            torch.arange(0.0, 1.0, 0.1) + x.mean(),
            torch.full((2, 3), 7, dtype=torch.int64),
            torch.zeros_like(x) + torch.ones(1),
        ],
        (rand(3),),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_operators_match_torch(name: str) -> None:
    fn, args = CASES[name]
    check(fn, *args)


def test_convolutions_forward_and_backward() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, wt: torch.Tensor, b: torch.Tensor) -> Any:
        x, w, wt, b = map(_leaf, (x, w, wt, b))
        y = F.conv2d(x, w, b, stride=2, padding=1, dilation=1, groups=2)
        z = F.conv_transpose2d(y, wt, stride=2, padding=1, output_padding=1)
        loss = (z * z).sum() + y.sum()
        return [y, z, *grads(loss, x, w, wt, b)]

    check(fn, rand(2, 4, 9, 9), rand(6, 2, 3, 3), rand(6, 3, 3, 3), rand(6))


def test_pooling_forward_and_backward_with_ties() -> None:
    def fn(x: torch.Tensor) -> Any:
        x = _leaf(x)
        r = torch.relu(x)  # zeros: ties inside a window, which torch breaks by position
        m, idx = F.max_pool2d(r, 3, 2, padding=1, return_indices=True)
        a = F.avg_pool2d(x, 3, 2, padding=1, ceil_mode=True, count_include_pad=False)
        a2 = F.avg_pool2d(x, 2)
        loss = (m * m).sum() + (a * a).sum() + a2.sum()
        return [m, idx, a, a2, *grads(loss, x)]

    check(fn, rand(2, 3, 8, 7))


def test_norms_embedding_attention_loss_forward_and_backward() -> None:
    def fn(x: torch.Tensor, ids: torch.Tensor, emb: torch.Tensor, w: torch.Tensor) -> Any:
        x, emb, w = map(_leaf, (x, emb, w))
        rm, rv = torch.zeros(4), torch.ones(4)
        bn = F.batch_norm(x, rm, rv, w, None, training=True, momentum=0.1)
        ln = F.layer_norm(x.permute(0, 2, 3, 1), (4,), w)
        gn = F.group_norm(x, 2, w)
        e = F.embedding(ids, emb)
        q = e.view(2, 3, 2, 2).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        ce = F.cross_entropy(e.sum(-1), ids[:, 0] % 3, label_smoothing=0.1)
        loss = (bn * bn).sum() + ln.sum() + (gn * x).sum() + (att * att).sum() + ce
        return [bn, rm, rv, ln, gn, att, ce, *grads(loss, x, emb, w)]

    check(fn, rand(3, 4, 2, 2), torch.tensor([[1, 2, 0], [4, 4, 1]]), rand(5, 4), rand(4))


def test_one_per_row_gather_is_bit_for_bit_torch() -> None:
    # Lowered as a sum from -0.0 over the row with the other positions made -0.0: the
    # picked value itself, whatever it is (-0.0, -inf, NaN), and whatever the rest of the
    # row holds.
    x = torch.tensor(
        [[-0.0, 1.0, float("nan")], [float("-inf"), float("inf"), 2.0],
         [float("nan"), -3.0, float("-inf")], [0.5, -0.0, float("inf")]]
    )  # fmt: skip
    idx = torch.tensor([[0], [0], [0], [1]])
    (got,) = lowered(lambda x, i: [torch.gather(x, 1, i)], x, idx)
    want = torch.gather(x, 1, idx).numpy()
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes(), (got, want)


def test_cross_entropy_has_no_scatter_or_gather() -> None:
    # nll_loss's backward puts -1 at each target of a (tokens, classes) zero tensor: as a
    # scatter XLA wrote that tensor whole (on a TPU, flat and then relaid out: 3 ms of a
    # 55M GPT's step); as a comparison it fuses into the consumers. Its forward gathers
    # each target's log-probability: as a gather XLA wrote the whole float32 log-softmax
    # to read one value per row; as a max over the row it was one more pass over the
    # logits; as a one-hot sum the runtime reads one logit per row. Same values.
    def fn(logits: torch.Tensor, target: torch.Tensor) -> Any:
        logits = _leaf(logits)
        loss = F.cross_entropy(logits, target, ignore_index=2)
        return [loss, *grads(loss, logits)]

    args = (rand(6, 7), torch.tensor([0, 2, 6, 3, 2, 1]))
    check(fn, *args)
    graph = traced(fn, *args)
    assert any(n.target is torch.ops.aten.scatter.value for n in graph.gm.graph.nodes)
    assert any(n.target is torch.ops.aten.gather.default for n in graph.gm.graph.nodes)
    with jax.enable_x64(True):
        exported = jax.export.export(jax.jit(lambda *xs: evaluate(graph, xs, None)))(
            *(jnp.asarray(a.numpy()) for a in args)
        )
    text = exported.mlir_module()
    assert "stablehlo.scatter" not in text
    assert "stablehlo.gather" not in text
    # torch.where written as the select itself (jnp.where is a call of a private
    # function): the runtime's one-hot rewrite then sees the backward's per-token sum of
    # the nll gradient over the classes and reads it at the target instead.
    assert "call @_where" not in text
    # The forward's pick of each target is a one-hot sum too, and the log-softmax is
    # written out rather than called, so that the rewrite follows the pick back to the
    # logits (a call's result would be gathered whole: XLA then writes the log-softmax).
    assert "call @log_softmax" not in text
    assert count_onehot_reductions(parse_artifact(exported.mlir_module_serialized)) == 2


def test_a_target_past_the_classes_makes_the_loss_infinite() -> None:
    # Eager PyTorch raises for a target outside [0, C) that is not ignore_index (padding
    # labelled -1, a vocabulary one short); a program cannot raise, so the pick gives
    # -inf and the loss +inf, which stop_on_nonfinite catches. The one-hot sum alone
    # gave -0.0: the row added nothing and the loss stayed finite.
    def fn(logits: torch.Tensor, target: torch.Tensor) -> Any:
        return [F.cross_entropy(logits, target)]

    for bad in (-1, 5):
        target = torch.tensor([1, 2, 3, bad])
        with pytest.raises(IndexError):
            fn(rand(4, 5), target)
        (loss,) = lowered(fn, rand(4, 5), target)
        assert loss == np.inf, (bad, loss)
    check(fn, rand(4, 5), torch.tensor([1, 2, 3, 4]))


def test_a_linear_bias_gradient_sums_the_unflattened_gradient() -> None:
    # autograd flattens a Linear's output gradient to (B*T, C) and sums dim 0 for the
    # bias; the program sums the (B, T, C) gradient over (B, T) instead: on a TPU the
    # flattened sum made XLA lay the 55M GPT's qkv gradient out column-major and copy
    # the attention kernels' gradients twice (benchmarks/results/frontend_gap-v5e.md).
    # The same float32 sum of the same values; the flattened view stays for the products.
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
        w, b = _leaf(w), _leaf(b)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(x, w, b)
        loss = (y.float() ** 2).sum()
        return [loss, *grads(loss, w, b)]

    args = (rand(2, 8, 6), rand(5, 6), rand(5))
    check(fn, *args, rtol=1e-2)  # bf16 products and gradients, as torch rounds them
    graph = traced(fn, *args)
    text = parse_artifact(lower(graph)).text()
    sums = [ln for ln in text.splitlines() if "applies stablehlo.add" in ln]
    assert any("dimensions = [0, 1] : (tensor<2x8x5xf32>" in ln for ln in sums), sums
    assert not any("(tensor<16x5xf32>" in ln for ln in sums), sums
    # lower() rewrote graph.gm in place: the rewritten graph's values are torch's.
    with jax.enable_x64(True):
        got = jax.jit(lambda *xs: evaluate(graph, xs, None))(
            *(jnp.asarray(a.numpy()) for a in args)
        )
    for g, w in zip(got, fn(*args)):
        np.testing.assert_allclose(np.asarray(g, np.float32), w.detach().float().numpy(), rtol=1e-2)


def test_outer_products_are_multiplications() -> None:
    # A product that sums over one element (rotary embeddings' inv_freq @ positions) is
    # lowered as the multiplication it is: the same values as torch, and no dot_general
    # whose operands a TPU's matmul precision could round.
    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
        return [
            a[:, :1] @ b[:1],
            a[None, :, :1] @ b[None, :1],
            torch.addmm(c, a[:, :1], b[:1]),
            a[:, :1].bfloat16() @ b[:1].bfloat16(),
        ]

    args = (rand(5, 3), rand(3, 4) * 1000, rand(5, 4))
    check(fn, *args)
    graph = traced(fn, *args)
    with jax.enable_x64(True):
        text = (
            jax.jit(lambda *xs: evaluate(graph, xs, None))
            .lower(*(jnp.asarray(a.numpy()) for a in args))
            .as_text()
        )
    assert "dot_general" not in text


def test_half_precision_matches_torch_rounding() -> None:
    # bf16 results are computed in float32 and rounded once per operator, as torch does.
    check(
        lambda a, b: [a @ b, F.softmax(a, -1), (a * 3).exp(), a.sum(0)],
        rand(4, 8, dtype=torch.bfloat16),
        rand(8, 3, dtype=torch.bfloat16),
        rtol=1e-2,
    )


def test_an_operator_without_lowering_is_named() -> None:
    with pytest.raises(UnsupportedOperator) as info:
        lowered(lambda x: [torch.linalg.qr(x)[0]], rand(3, 3))
    assert "qr" in str(info.value.op)
