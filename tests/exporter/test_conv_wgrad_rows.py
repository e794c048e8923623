"""A CNN's train step with its weight gradients as row loops (stablehlo/conv_wgrad.py, the
runtime's TPU rewrite), run on the CPU: the weights after one SGD step are PyTorch's in
float64 on the CPU, as the unrewritten program's are.

The runtime rewrites only on TPUs; here the pipeline's "weight-gradients" entry is
swapped for one that rewrites on any platform, so the rewritten program is the one the
CPU compiles. Exported with torch_xla, run in this process (jax 0.7.1).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from stepbundle.exporter import Recipe, export
from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.runtime.compile import rewrites
from stepbundle.stablehlo.conv_wgrad import rewrite_weight_gradients

LR = 0.5  # large, so the step's change dominates float32 rounding of the weights


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(  # windows of 16x16 and 8x8 for the weight gradients
        torch.nn.Conv2d(3, 4, 3, padding=1, bias=False),
        torch.nn.ReLU(),
        torch.nn.Conv2d(4, 5, 3, padding=1),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(5, 6, 3, padding=1),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 8 * 8, 3),
    )


def _step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "x": rng.normal(size=(4, 3, 16, 16)).astype(np.float32),
        "y": rng.integers(0, 3, 4).astype(np.int64),
    }


@pytest.fixture
def rows_everywhere(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pipeline with the weight-gradient rewrite on every platform; the list gets the
    number of convolutions it rewrote per program."""
    counts: list[int] = []

    def rewrite(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        counts.append(rewrite_weight_gradients(stage.module))
        return stage

    table = tuple(
        (name, rewrite if name == "weight-gradients" else r) for name, r in rewrites.REWRITES
    )
    monkeypatch.setattr(rewrites, "REWRITES", table)
    return counts


def test_row_loop_weight_gradients_step_like_pytorch_float64(
    tmp_path: Path, rows_everywhere: list[int]
) -> None:
    model = _model()
    path = tmp_path / "cnn.stepbundle"
    example = {k: torch.from_numpy(v) for k, v in _batch().items()}
    exported = copy.deepcopy(model)
    optimizer = torch.optim.SGD(exported.parameters(), lr=LR)
    export(Recipe(model=exported, optimizer=optimizer, step=_step, example_batch=example), path)
    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    assert rows_everywhere == [3]  # all three weight gradients became loops
    trainer.run([_batch()], 1)
    got = trainer.state_dict()

    ref = copy.deepcopy(model).double()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    batch = _batch()
    _step(ref, opt, {"x": torch.from_numpy(batch["x"]).double(), "y": torch.from_numpy(batch["y"])})
    for name, want in ref.state_dict().items():
        w = want.numpy()
        change = np.max(np.abs(w - model.state_dict()[name].double().numpy()))
        err = np.max(np.abs(np.asarray(got[name], np.float64) - w))
        assert change > 1e-3, name  # the step moved every weight
        assert err < 1e-5 * max(1.0, change), (name, err, change)
