"""torch's classification losses as torch_xla 2.9 writes them, run through the runtime's
one-hot rewrite (stablehlo/onehot.py turns their sums over a one-hot of the targets into
the values at the targets): every form below has such sums, and the bundle replays
torch_xla eager step for step and starts from PyTorch's float64 loss on the CPU.

Targets divisible by 4 are ignored (-100), so every batch has ignored tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from export_helpers import check_equivalent
from support import run_bundle_inprocess

from stepbundle.exporter import Recipe
from stepbundle.schema import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.onehot import count_onehot_reductions, rewrite_onehot_reductions

V, B, T = 37, 3, 5
F = torch.nn.functional


def _ignored(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t % 4 == 0, torch.full_like(t, -100), t)


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": lambda z, t: F.cross_entropy(z.reshape(-1, V), t.reshape(-1)),
    "label smoothing": lambda z, t: F.cross_entropy(
        z.reshape(-1, V), t.reshape(-1), label_smoothing=0.1
    ),
    "sum": lambda z, t: F.cross_entropy(z.reshape(-1, V), t.reshape(-1), reduction="sum"),
    "classes in dim 1": lambda z, t: F.cross_entropy(z.transpose(1, 2), t),
    "class weights": lambda z, t: F.cross_entropy(
        z.reshape(-1, V),
        t.reshape(-1),
        weight=torch.linspace(0.5, 1.5, V, device=z.device, dtype=z.dtype),
    ),
    "nll of log_softmax": lambda z, t: F.nll_loss(
        F.log_softmax(z, -1).reshape(-1, V), t.reshape(-1)
    ),
}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, 16)
        self.head = torch.nn.Linear(16, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(idx)))


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "idx": torch.randint(0, V, (B, T), generator=g),
        "target": torch.randint(0, V, (B, T), generator=g),
    }


def _recipe(loss: Callable[..., torch.Tensor]) -> Callable[[], Recipe]:
    def step(model: Any, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        optimizer.zero_grad()
        out = loss(model(batch["idx"]), _ignored(batch["target"]))
        out.backward()
        optimizer.step()
        return {"loss": out}

    def make() -> Recipe:
        torch.manual_seed(0)
        model = Tiny()
        return Recipe(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            step=step,
            example_batch=_batch(),
        )

    return make


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_classification_loss_replays_with_onehot_rewrite(name: str, tmp_path: Path) -> None:
    make = _recipe(LOSSES[name])
    manifest = check_equivalent(make, tmp_path, steps=3, name="loss")
    path = tmp_path / "loss.stepbundle"
    with open_bundle(path) as b:
        section = manifest.entries["train"].programs[0].section
        module = mlir.parse_artifact(bytes(b.section(section)))
    n = count_onehot_reductions(module)
    assert n >= 1, "torch_xla wrote no one-hot sum here"
    # The runtime's rewrite takes every one of them (a failure would only warn at load).
    assert rewrite_onehot_reductions(module) == n
    assert count_onehot_reductions(module) == 0
    # The first loss against PyTorch in float64 on the CPU (no XLA, no stepbundle).
    torch.manual_seed(0)
    ref = Tiny().double()
    batch = _batch()
    want = float(LOSSES[name](ref(batch["idx"]), _ignored(batch["target"])))
    batches = [{k: v.numpy() for k, v in batch.items()}]
    got = float(run_bundle_inprocess(path, batches, 1).series("loss")[0])
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (got, want)
