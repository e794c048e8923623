"""A runtime checkpoint back in PyTorch: ``load_into`` restores the state and the declared
hyperparameters, tuple elements included (Adam's ``betas.0``), for either front-end.

The bundle runs a few steps in the runtime with beta1 and lr set away from the recipe's
values, saves a checkpoint, and ``load_into`` puts it into a fresh model and optimizer.
The oracle is PyTorch on the CPU trained the same steps with those values from the
start: parameters, optimizer state and ``betas`` must agree, and one more step from the
loaded state must match the runtime's next step (a beta1 left at the recipe's value
would not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import make_batches, mse_step

from stepbundle.frontend import Recipe
from stepbundle.frontend.checkpoint import load_into
from stepbundle.runtime import CompileOptions, LoadOptions, load

STEPS = 3
BETA1, LR = 0.85, 0.02


def _recipe(adam: dict[str, Any], *, betas: tuple[float, float] = (0.9, 0.99), lr: float = 0.01):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.01, **adam)
    g = torch.Generator().manual_seed(0)
    return Recipe(
        model=model,
        optimizer=opt,
        step=mse_step,
        example_batch={"x": torch.randn(16, 5, generator=g), "y": torch.randn(16, 3, generator=g)},
        hyperparameters=("lr", "betas.0"),
    )


def _batch(b: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in b.items()}


def _rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def test_load_into_restores_state_and_beta1_after_runtime_steps(frontend, tmp_path: Path) -> None:
    path = tmp_path / "adamw.stepbundle"
    frontend.export(_recipe(frontend.adam), path)
    batches = make_batches(_recipe(frontend.adam), STEPS + 1)
    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    trainer.set_hyperparameter("betas.0", BETA1)
    trainer.set_hyperparameter("lr", LR)
    trainer.run(batches[:STEPS], STEPS)
    ckpt = tmp_path / "ckpt.safetensors"
    trainer.save_checkpoint(ckpt)
    runtime_next = float(np.asarray(trainer.step(batches[STEPS])["loss"]))
    runtime_state = {k: np.asarray(v) for k, v in trainer.state_dict().items()}

    # A fresh model and optimizer, on the CPU (the recipe's own settings: beta1 0.9).
    r = _recipe(frontend.adam)
    meta = load_into(r.model, r.optimizer, ckpt)
    assert meta.step == STEPS
    group = r.optimizer.param_groups[0]
    assert "betas.0" not in group, "load_into wrote a key 'betas.0' instead of beta1"
    assert group["betas"][0] == pytest.approx(BETA1, abs=1e-7)
    assert group["betas"][1] == 0.99  # beta2 is not a hyperparameter: kept
    assert group["lr"] == pytest.approx(LR, abs=1e-9)
    for g in r.optimizer.param_groups:
        g["capturable"] = False  # torch steps a capturable Adam on accelerators only

    # The oracle: PyTorch on the CPU with beta1 and lr at the runtime's values throughout.
    ref = _recipe({}, betas=(BETA1, 0.99), lr=LR)
    for b in batches[:STEPS]:
        ref.step(ref.model, ref.optimizer, _batch(b))
    worst = 0.0
    for (name, p), q in zip(r.model.named_parameters(), ref.model.parameters()):
        worst = max(worst, _rel(p.detach(), q.detach()))
        st, rst = r.optimizer.state[p], ref.optimizer.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            worst = max(worst, _rel(st[key], rst[key]))
        assert float(st["step"]) == float(rst["step"]) == STEPS, name
    assert worst <= 1e-5, worst

    # One more step from the loaded state: PyTorch's matches the runtime's next step.
    loss = float(r.step(r.model, r.optimizer, _batch(batches[STEPS]))["loss"].detach())
    assert loss == pytest.approx(runtime_next, rel=1e-5)
    for name, p in r.model.named_parameters():
        assert _rel(p.detach(), runtime_state[name]) <= 1e-5, name


def test_load_into_refuses_a_damaged_checkpoint_and_changes_nothing(
    frontend, tmp_path: Path
) -> None:
    """The runtime refuses a checkpoint whose bytes do not match its digest; so does
    ``load_into``, before it copies anything into the model."""
    from stepbundle.runtime import CheckpointError

    path = tmp_path / "adamw.stepbundle"
    frontend.export(_recipe(frontend.adam), path)
    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    trainer.run(make_batches(_recipe(frontend.adam), 2), 2)
    ckpt = tmp_path / "ckpt.safetensors"
    trainer.save_checkpoint(ckpt)
    data = bytearray(ckpt.read_bytes())
    data[-1] ^= 0x40  # the last byte of the last tensor
    ckpt.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match="is damaged"):
        trainer.load_checkpoint(ckpt)
    r = _recipe(frontend.adam)
    before = {k: v.clone() for k, v in r.model.state_dict().items()}
    with pytest.raises(CheckpointError, match="is damaged"):
        load_into(r.model, r.optimizer, ckpt)
    assert all(torch.equal(before[k], v) for k, v in r.model.state_dict().items())
    assert not r.optimizer.state
