"""Every torch.optim optimizer, as the user wrote it, exports on both front-ends (issue #39
item 4): fresh and stepped, capturable or not; each bundle matches eager PyTorch on the CPU
over 3 steps.

The oracle is plain PyTorch on the CPU with the user's own settings (a capturable
optimizer with ``capturable=False``: torch refuses a capturable step on the CPU and
documents both as the same algorithm). Where the bundle and float32 eager disagree beyond
``RTOL``, PyTorch float64 decides: the bundle must be as close to it as float32 eager is.
The non-capturable Adamax, NAdam, RAdam, ASGD and Rprop are traced with ``capturable=True``
by the front-end itself, and the export says so.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from stepbundle.frontend.recipe import Recipe
from stepbundle.runtime import load

STEPS = 3
RTOL = 2e-5
optim = torch.optim

CASES: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (optim.SGD, {"lr": 0.05}),
    "SGD momentum": (optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "SGD nesterov": (optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "Adam": (optim.Adam, {"lr": 0.05}),
    "Adam capturable": (optim.Adam, {"lr": 0.05, "capturable": True}),
    "AdamW": (optim.AdamW, {"lr": 0.05}),
    "AdamW capturable amsgrad": (optim.AdamW, {"lr": 0.05, "capturable": True, "amsgrad": True}),
    "NAdam": (optim.NAdam, {"lr": 0.05}),
    "NAdam capturable": (optim.NAdam, {"lr": 0.05, "capturable": True}),
    "RAdam": (optim.RAdam, {"lr": 0.05}),
    "RAdam capturable": (optim.RAdam, {"lr": 0.05, "capturable": True}),
    "RMSprop": (optim.RMSprop, {"lr": 0.01}),
    "RMSprop centered momentum": (optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    "RMSprop capturable": (optim.RMSprop, {"lr": 0.01, "capturable": True}),
    "Adamax": (optim.Adamax, {"lr": 0.05}),
    "Adamax capturable": (optim.Adamax, {"lr": 0.05, "capturable": True}),
    "Adagrad": (optim.Adagrad, {"lr": 0.1}),
    "Adadelta": (optim.Adadelta, {"lr": 1.0}),
    "ASGD": (optim.ASGD, {"lr": 0.05, "t0": 1.0}),
    "ASGD capturable": (optim.ASGD, {"lr": 0.05, "t0": 1.0, "capturable": True}),
    "Rprop": (optim.Rprop, {"lr": 0.01}),
    "Rprop capturable": (optim.Rprop, {"lr": 0.01, "capturable": True}),
}


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    return {"loss": loss}


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [{"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 2, generator=g)}
            for _ in range(STEPS + 1)]  # fmt: skip


def _recipe(case: str, stepped: bool) -> Recipe:
    make, kwargs = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = make(model.parameters(), **kwargs)
    batches = _batches()
    if stepped:  # one eager step first: the optimizer holds its state
        eager = copy.deepcopy(opt.param_groups)
        for g in opt.param_groups:
            g["capturable"] = False if "capturable" in g else None
        _step(model, opt, batches[-1])
        for g, saved in zip(opt.param_groups, eager):
            g["capturable"] = saved.get("capturable")
            if g["capturable"] is None:
                del g["capturable"]
    return Recipe(model, opt, _step, batches[0])


def _eager(recipe: Recipe, dtype: torch.dtype) -> tuple[list[float], dict[str, np.ndarray]]:
    model, opt = copy.deepcopy((recipe.model, recipe.optimizer))
    model.to(dtype)
    for st in opt.state.values():
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                st[k] = v.to(dtype)
    for g in opt.param_groups:
        if g.get("capturable"):
            g["capturable"] = False
    losses = []
    for b in _batches()[:STEPS]:
        out = _step(model, opt, {k: v.to(dtype) for k, v in b.items()})
        losses.append(float(out["loss"]))
    names = {id(p): n for n, p in model.named_parameters()}
    state = {n: p.detach().double().numpy() for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                state[f"optimizer.state.{names[id(p)]}.{k}"] = v.detach().double().numpy()
    return losses, state


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-6) if b.size else 0.0


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_optimizer_exports_and_matches_eager(
    frontend: Any, case: str, stepped: bool, tmp_path: Path
) -> None:
    recipe = _recipe(case, stepped)
    lines: list[str] = []
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                   for g in recipe.optimizer.param_groups])  # fmt: skip
    report = frontend.export(recipe, tmp_path / "b.stepbundle", progress=lines.append, check=False)
    assert [{k: v for k, v in g.items() if k != "params"}
            for g in recipe.optimizer.param_groups] == groups_before  # fmt: skip
    name, kwargs = type(recipe.optimizer).__name__, CASES[case][1]
    if name in ("Adamax", "NAdam", "RAdam", "ASGD", "Rprop") and not kwargs.get("capturable"):
        assert any("traced with capturable=True" in line for line in lines), lines
    # The session's compile cache (tests/conftest.py): a stepped bundle's train program is
    # its fresh twin's, byte for byte (the state's values are not in the program), so the
    # second of the pair is a verified hit instead of a second compile.
    trainer = load(report.path)
    got_losses = [float(np.asarray(trainer.step({k: v.numpy() for k, v in b.items()})["loss"]))
                  for b in _batches()[:STEPS]]  # fmt: skip
    got_state = {k: np.asarray(v) for k, v in trainer.state_dict().items()}
    ref_losses, ref_state = _eager(recipe, torch.float32)
    names = [n for n in ref_state if n in got_state]
    assert len(names) == len(ref_state), sorted(set(ref_state) - set(got_state))
    loss = _rel(np.array(got_losses), np.array(ref_losses))
    state = max(_rel(got_state[n], ref_state[n]) for n in names)
    if loss > RTOL or state > RTOL:
        f64_losses, f64_state = _eager(recipe, torch.float64)
        own = (_rel(np.array(ref_losses), np.array(f64_losses)),
               max(_rel(ref_state[n], f64_state[n]) for n in names))  # fmt: skip
        got = (_rel(np.array(got_losses), np.array(f64_losses)),
               max(_rel(got_state[n], f64_state[n]) for n in names))  # fmt: skip
        assert got[0] <= max(2 * own[0], RTOL) and got[1] <= max(2 * own[1], RTOL), (
            case, (loss, state), got, own)  # fmt: skip
