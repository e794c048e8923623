"""In-place writes into tensors the step itself makes are in the program (issue #39).

A step that builds a tensor (``torch.zeros``, ``ones``, ``full``, ``empty`` then filled,
``arange``, ``eye``) and writes into it (``t[i] = v``, ``fill_``, ``copy_``,
``masked_fill_``, ``scatter_``, ``index_put_``, ``add_``, ``mul_``, on the tensor and on
views of it) must be exported with the writes. The torch_xla front-end used to drop every
write through a view of such a tensor without a word: the guard against host reads was a
``TorchDispatchMode``, under which torch_xla's factory functions return tensors that
functionalization does not track. A vocabulary mask ``bad[5] = True`` and a key-padding
mask ``mask[..., -2:] = True`` vanished with them.

Each form contributes to the loss (so to the gradients and the trained state) and is also
returned as a metric of its own, so a form whose write is lost is named. The ground truth
is the same recipe trained by PyTorch on the CPU in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import assert_runs_close, make_batches, run_bundle_inprocess, train_eager_cpu

from stepbundle.frontend import Recipe

STEPS = 3
RTOL = 2e-5
N, D, C = 4, 6, 7


def _forms(h: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors made here and written in place: each reduced to a vector of C entries.

    ``h`` (N, C) is an activation, for writes whose value or mask comes from the step's
    data; everything is made on its device and in its dtype.
    """
    dev, dt = h.device, h.dtype

    def z(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, device=dev, dtype=dt)

    def o(*shape: int) -> torch.Tensor:
        return torch.ones(*shape, device=dev, dtype=dt)

    out: dict[str, torch.Tensor] = {}
    t = z(C)
    t[5] = 10.0
    out["zeros.setitem"] = t
    t = z(C)
    t[2:4] = h[0, :2]
    out["zeros.setitem_activation"] = t
    t = o(C)
    t[1:3].fill_(4.0)
    out["ones.slice_fill_"] = t
    t = torch.full((C,), 2.0, device=dev, dtype=dt)
    t[torch.tensor([0, 6], device=dev)] = 3.0
    out["full.index_put"] = t
    t = torch.full((C,), -1.0, device=dev, dtype=dt)
    t.fill_(0.5)
    out["full.fill_"] = t
    t = torch.empty(C, device=dev, dtype=dt)
    t.fill_(0.5)
    t[3] = -2.0
    out["empty.fill_then_setitem"] = t
    t = torch.empty(2, C, device=dev, dtype=dt)
    t.zero_()
    t[1].copy_(h[1])
    out["empty.zero_then_row_copy_"] = t.sum(0)
    t = torch.arange(C, device=dev, dtype=dt)
    t[4:].copy_(h[1, :3])
    out["arange.slice_copy_"] = t
    t = torch.arange(C, device=dev, dtype=dt)
    t.mul_(h[2])
    out["arange.mul_"] = t
    t = torch.eye(C, device=dev, dtype=dt)
    t.diagonal().mul_(3.0)
    t[0, 6] = 5.0
    out["eye.diagonal_mul_"] = h[3] @ t
    t = z(C)
    t.masked_fill_(torch.arange(C, device=dev) > 4, 6.0)
    out["zeros.masked_fill_"] = t
    t = z(2, C)
    t[1].masked_fill_(h[0] > 0, 2.0)
    out["zeros.row_masked_fill_"] = t.sum(0)
    idx = torch.tensor([1, 4], device=dev)
    t = z(C)
    t.scatter_(0, idx, h[2, :2])
    out["zeros.scatter_"] = t
    t = z(2, C)
    t[0].scatter_(0, idx, h[3, :2])
    out["zeros.row_scatter_"] = t.sum(0)
    t = z(C)
    t.index_put_((idx,), h[0, :2], accumulate=True)
    out["zeros.index_put_"] = t
    t = o(C)
    t.add_(h[0])
    out["ones.add_"] = t
    t = o(2, C)
    t[:, 3].add_(5.0)
    out["ones.column_add_"] = t.sum(0)
    t = o(C)
    t.mul_(h[1])
    out["ones.mul_"] = t
    t = o(C, 1)
    t.view(C)[2:5].mul_(-1.5)
    out["ones.view_slice_mul_"] = t.view(C)
    t = z(C)
    t.unsqueeze(0)[0, 6] = 8.0
    out["zeros.unsqueeze_setitem"] = t
    t = z(C, C)
    t.t()[0, 1] = 3.0  # the transposed view: t[1, 0]
    out["zeros.transpose_setitem"] = t.sum(0) + 2 * t.sum(1)
    return out


class _Net(torch.nn.Module):
    """Linear(D, C) whose forward adds every form (made inside forward) to its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(D, C)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.lin(x)
        forms = _forms(h)
        return h + 0.1 * torch.stack(list(forms.values())).sum(0), forms


def _form_metrics(forms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One number per form, weighing each entry differently (a write to the wrong entry
    shows too)."""
    return {
        k: (v * torch.arange(1, C + 1, device=v.device, dtype=v.dtype)).sum()
        for k, v in forms.items()
    }


def _forward_step(model, optimizer, batch):
    optimizer.zero_grad()
    out, forms = model(batch["x"])
    loss = F.mse_loss(out, batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss, **_form_metrics(forms)}


def _forward_recipe() -> Recipe:
    torch.manual_seed(0)
    model = _Net()
    g = torch.Generator().manual_seed(1)
    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        step=_forward_step,
        example_batch={"x": torch.randn(N, D, generator=g), "y": torch.randn(N, C, generator=g)},
    )


T, E = 5, 4  # tokens, width of the attention classifier


class _Attend(torch.nn.Module):
    """One attention over T tokens, then a classifier over C classes."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(E, E)
        self.k = torch.nn.Linear(E, E)
        self.v = torch.nn.Linear(E, E)
        self.head = torch.nn.Linear(E, C)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / E**0.5
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return self.head((scores.softmax(-1) @ self.v(x)).mean(1))


def _loss_step(model, optimizer, batch):
    """Masks and weights made in the step: a key-padding mask, a vocabulary mask, class
    weights, and a one-hot target written in place."""
    optimizer.zero_grad()
    x, t = batch["x"], batch["t"]
    pad = torch.zeros(x.shape[0], T, dtype=torch.bool, device=x.device)
    pad[..., -2:] = True  # the last two tokens are padding
    logits = model(x, pad)
    bad = torch.zeros(C, dtype=torch.bool, device=x.device)
    bad[5] = True  # class 5 is never predicted
    masked = logits.masked_fill(bad, float("-inf"))
    weight = torch.ones(C, dtype=logits.dtype, device=x.device)
    weight[2] = 3.0
    ce = F.cross_entropy(masked, t, weight=weight)
    onehot = torch.zeros_like(logits)
    onehot.scatter_(1, t[:, None], 1.0)
    hit = (logits.softmax(-1) * onehot).sum(-1).mean()
    loss = ce - 0.1 * hit
    loss.backward()
    optimizer.step()
    probs = masked.softmax(-1)
    return {
        "loss": loss,
        "ce": ce,
        "p_masked_class": probs[:, 5].sum(),  # exactly 0 only if the vocabulary mask is kept
        "hit": hit,
    }


def _loss_recipe() -> Recipe:
    torch.manual_seed(0)
    model = _Attend()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, T, E, generator=g)
    # Padding tokens hold large values: attending to them would move the loss a lot.
    x[:, -2:] = 5.0 * torch.randn(N, 2, E, generator=g)
    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        step=_loss_step,
        example_batch={"x": x, "t": torch.tensor([0, 2, 3, 6])},
    )


def _batches(recipe_fn: Callable[[], Recipe]) -> list[dict[str, np.ndarray]]:
    r = recipe_fn()
    if recipe_fn is _loss_recipe:
        # Other targets, never the masked class 5 (its loss would be infinite).
        first = {k: v.numpy() for k, v in r.example_batch.items()}
        return [first, {**first, "t": np.array([1, 2, 4, 0])}]
    return make_batches(r, 2)


@pytest.mark.parametrize("recipe_fn", [_forward_recipe, _loss_recipe], ids=["forward", "loss"])
def test_writes_into_tensors_made_in_the_step_are_kept(
    frontend, recipe_fn: Callable[[], Recipe], tmp_path: Path
) -> None:
    path = tmp_path / "made.stepbundle"
    frontend.export(recipe_fn(), path)
    batches = _batches(recipe_fn)
    got = run_bundle_inprocess(path, batches, STEPS)
    ref = train_eager_cpu(recipe_fn, batches, STEPS, float64=True)
    # Every form, one metric each: a lost write names its form here.
    assert_runs_close(got, ref, rtol=RTOL, what=f"{frontend.name} {recipe_fn.__name__}")
    if recipe_fn is _loss_recipe:
        assert all(m["p_masked_class"] == 0.0 for m in got.metrics)


def _forward_eval(model, batch):
    out, forms = model(batch["x"])
    return {"mse": F.mse_loss(out, batch["y"]), **_form_metrics(forms)}


def test_an_eval_entry_keeps_them_too(frontend, tmp_path: Path) -> None:
    """A read-only entry is traced under the same guard: its writes are kept as well."""
    from stepbundle.runtime import CompileOptions, LoadOptions, load

    recipe = _forward_recipe()
    recipe.eval_step = _forward_eval
    path = tmp_path / "eval.stepbundle"
    frontend.export(recipe, path)
    batch = make_batches(recipe, 2)[1]
    got = load(path, "cpu", LoadOptions(compile=CompileOptions(cache_dir=False))).evaluate(batch)
    model = _forward_recipe().model.double()  # the same initial weights, in float64
    model.eval()
    with torch.no_grad():
        want = _forward_eval(model, {k: torch.from_numpy(v).double() for k, v in batch.items()})
    assert set(got) == set(want)
    for k, v in want.items():
        g = float(np.asarray(got[k]))
        assert abs(g - float(v)) <= RTOL * max(1.0, abs(float(v))), (k, g, float(v))


def test_the_oracle_sees_every_write() -> None:
    """Without its write, each form's metric differs from the reference's: the test above
    would catch any one write lost (the oracle is not blind to it)."""
    h = torch.randn(N, C, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    forms = _form_metrics(_forms(h))
    # The same forms with every in-place write left out, by hand.
    w = torch.arange(1, C + 1, dtype=torch.float64)
    dt = torch.float64
    unwritten = {
        "zeros.setitem": torch.zeros(C, dtype=dt),
        "zeros.setitem_activation": torch.zeros(C, dtype=dt),
        "ones.slice_fill_": torch.ones(C, dtype=dt),
        "full.index_put": torch.full((C,), 2.0, dtype=dt),
        "full.fill_": torch.full((C,), -1.0, dtype=dt),
        "arange.slice_copy_": torch.arange(C, dtype=dt),
        "arange.mul_": torch.arange(C, dtype=dt),
        "eye.diagonal_mul_": h[3],
        "zeros.masked_fill_": torch.zeros(C, dtype=dt),
        "zeros.row_masked_fill_": torch.zeros(C, dtype=dt),
        "zeros.scatter_": torch.zeros(C, dtype=dt),
        "zeros.row_scatter_": torch.zeros(C, dtype=dt),
        "zeros.index_put_": torch.zeros(C, dtype=dt),
        "ones.add_": torch.ones(C, dtype=dt),
        "ones.column_add_": 2 * torch.ones(C, dtype=dt),
        "ones.mul_": torch.ones(C, dtype=dt),
        "ones.view_slice_mul_": torch.ones(C, dtype=dt),
        "zeros.unsqueeze_setitem": torch.zeros(C, dtype=dt),
        "zeros.transpose_setitem": torch.zeros(C, dtype=dt),
    }
    for name, v in unwritten.items():
        lost = float((v * w).sum())
        # 100 times the tolerance the bundles are held to.
        assert abs(float(forms[name]) - lost) > 100 * RTOL * max(1.0, abs(lost)), name
