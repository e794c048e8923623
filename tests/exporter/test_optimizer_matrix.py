"""Every torch.optim optimizer, exported from a fresh state, matches eager from step 1.

Each case builds a fresh optimizer over a tiny MLP, exports it, runs the bundle for 3
steps with the runtime, and compares every loss and every state tensor (parameters and
optimizer state) with the same recipe trained by torch_xla eagerly. Capturable
optimizers cannot step eagerly on XLA (torch's capturable device check lacks ``xla``), so
their torch_xla reference is the same optimizer with ``capturable=False``, which torch
documents as the same algorithm; PyTorch float64 on the CPU is the ground truth both are
held to. ``benchmarks/results/optimizer_matrix.md`` is this file's printed table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import (
    Run,
    make_batches,
    max_rel_diff,
    run_bundle_inprocess,
    train_eager_cpu,
    train_eager_xla,
)

from stepbundle.exporter import ExportError, Recipe, export

STEPS = 3
# Tight: the bundle is torch_xla's own graph of the step. Differences come from float32
# tensor arithmetic where eager torch computes step-dependent factors in Python float64.
RTOL = 1e-6

Opt = Callable[[Any], torch.optim.Optimizer]

CASES: dict[str, tuple[Opt, dict[str, Any]]] = {
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "Adagrad lr_decay wd": (
        torch.optim.Adagrad,
        {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.01, "initial_accumulator_value": 0.1},
    ),
    "Adagrad foreach": (torch.optim.Adagrad, {"lr": 0.1, "foreach": True}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01}),
    "RMSprop centered momentum": (
        torch.optim.RMSprop,
        {"lr": 0.01, "momentum": 0.9, "centered": True, "weight_decay": 0.01},
    ),
    "RMSprop capturable": (torch.optim.RMSprop, {"lr": 0.01, "capturable": True}),
    "RMSprop foreach": (torch.optim.RMSprop, {"lr": 0.01, "foreach": True}),
    "Adamax capturable": (torch.optim.Adamax, {"lr": 0.05, "capturable": True}),
    "Adamax capturable foreach": (
        torch.optim.Adamax,
        {"lr": 0.05, "capturable": True, "foreach": True},
    ),
    "NAdam capturable": (torch.optim.NAdam, {"lr": 0.05, "capturable": True}),
    "NAdam capturable decoupled": (
        torch.optim.NAdam,
        {"lr": 0.05, "capturable": True, "weight_decay": 0.01, "decoupled_weight_decay": True},
    ),
    "RAdam capturable": (torch.optim.RAdam, {"lr": 0.05, "capturable": True}),
    "ASGD capturable": (torch.optim.ASGD, {"lr": 0.05, "capturable": True, "t0": 1.0}),
    "Rprop capturable": (torch.optim.Rprop, {"lr": 0.01, "capturable": True}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "Adadelta capturable": (torch.optim.Adadelta, {"lr": 1.0, "capturable": True}),
    "Adadelta foreach": (torch.optim.Adadelta, {"lr": 1.0, "foreach": True}),
    "Adafactor": (torch.optim.Adafactor, {"lr": 0.05}),
    "Adafactor wd": (torch.optim.Adafactor, {"lr": 0.05, "weight_decay": 0.01}),
    "Adafactor foreach": (torch.optim.Adafactor, {"lr": 0.05, "foreach": True}),
    # foreach=True with capturable=True, which torch's device check refused on XLA.
    "NAdam capturable foreach": (
        torch.optim.NAdam,
        {"lr": 0.05, "capturable": True, "foreach": True},
    ),
    "RAdam capturable foreach": (
        torch.optim.RAdam,
        {"lr": 0.05, "capturable": True, "foreach": True},
    ),
    "ASGD capturable foreach": (
        torch.optim.ASGD,
        {"lr": 0.05, "capturable": True, "t0": 1.0, "foreach": True},
    ),
    "Rprop capturable foreach": (
        torch.optim.Rprop,
        {"lr": 0.01, "capturable": True, "foreach": True},
    ),
    "Adadelta capturable foreach": (
        torch.optim.Adadelta,
        {"lr": 1.0, "capturable": True, "foreach": True},
    ),
    "Adam capturable foreach": (
        torch.optim.Adam,
        {"lr": 0.05, "capturable": True, "foreach": True},
    ),
    "AdamW capturable amsgrad foreach": (
        torch.optim.AdamW,
        {"lr": 0.05, "capturable": True, "amsgrad": True, "foreach": True},
    ),
    "SGD nesterov foreach": (
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "foreach": True},
    ),
}


def _step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _recipe(
    make: Opt, kwargs: dict[str, Any], dtype: torch.dtype = torch.float32
) -> Callable[[], Recipe]:
    def recipe() -> Recipe:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)
        ).to(dtype)
        g = torch.Generator().manual_seed(1)
        batch = {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 2, generator=g)}

        def step(model, optimizer, batch):
            return _step(model, optimizer, {k: v.to(dtype) for k, v in batch.items()})

        return Recipe(
            model=model,
            optimizer=make(model.parameters(), **kwargs),
            step=step if dtype != torch.float32 else _step,
            example_batch=batch,
        )

    return recipe


def _eager_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The settings eager torch can step with on the CPU: not capturable."""
    return {k: v for k, v in kwargs.items() if k != "capturable"}


def _capturable_on_xla(recipe_fn: Callable[[], Recipe]) -> Callable[[], Recipe]:
    """The recipe, its optimizer stepping eagerly on XLA with capturable=True.

    torch's capturable optimizers assert that their tensors are on a device in
    ``_get_capturable_supported_devices()``, which lacks ``xla``; the check is skipped
    while ``torch.compiler.is_compiling()`` is true. The flag is set for the duration of
    ``optimizer.step()`` only: torch's own capturable update then runs eagerly, from the
    state torch itself creates lazily.
    """

    def recipe() -> Recipe:
        r = recipe_fn()
        import torch.compiler as tc

        def pre(*_: Any) -> None:
            tc._is_compiling_flag = True

        def post(*_: Any) -> None:
            tc._is_compiling_flag = False

        r.optimizer.register_step_pre_hook(pre)
        r.optimizer.register_step_post_hook(post)
        return r

    return recipe


def _worst(got: Run, ref: Run) -> tuple[float, float]:
    loss = max(
        max_rel_diff(np.array(g["loss"]), np.array(r["loss"]))
        for g, r in zip(got.metrics, ref.metrics)
    )
    state = max(max_rel_diff(got.state[k], v) for k, v in ref.state.items() if k in got.state)
    return loss, state


@pytest.mark.parametrize("case", list(CASES))
def test_fresh_optimizer_matches_eager_from_step_one(case: str, tmp_path: Path) -> None:
    make, kwargs = CASES[case]
    recipe_fn = _recipe(make, kwargs)
    path = tmp_path / "opt.stepbundle"
    export(recipe_fn(), path)
    batches = make_batches(recipe_fn(), 3)
    got = run_bundle_inprocess(path, batches, STEPS)
    same = _capturable_on_xla(recipe_fn) if kwargs.get("capturable") else recipe_fn
    xla = train_eager_xla(same, batches, STEPS)
    f64 = train_eager_cpu(_recipe(make, _eager_kwargs(kwargs), torch.float64), batches, STEPS)
    f32 = train_eager_cpu(_recipe(make, _eager_kwargs(kwargs)), batches, STEPS)
    # Every optimizer state tensor torch creates is in the bundle, under torch's names.
    assert set(xla.state) - set(got.state) <= {k for k in xla.state if k.endswith(".grad")}
    assert any(k.startswith("optimizer.state.") for k in got.state)
    assert got.series("loss")[0] != got.series("loss")[-1]
    loss, state = _worst(got, xla)
    loss64, state64 = _worst(got, f64)
    ref64 = _worst(f32, f64)
    settings = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    print(
        f"| {case} | {settings} | {loss:.2g} | {state:.2g} | {loss64:.2g} / {state64:.2g} | "
        f"{ref64[0]:.2g} / {ref64[1]:.2g} |"
    )
    if loss > RTOL or state > RTOL:
        # When the bundle and torch_xla disagree, PyTorch float64 decides: the bundle
        # must be as close to it as PyTorch float32 is.
        assert loss64 <= max(2 * ref64[0], RTOL) and state64 <= max(2 * ref64[1], RTOL), (
            case,
            (loss, state),
            (loss64, state64),
            ref64,
        )


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (torch.optim.Adam, {"fused": True, "capturable": True}, r"fused=True.*fused=False"),
        (torch.optim.SGD, {"differentiable": True}, r"differentiable=True.*differentiable=False"),
    ],
    ids=["fused", "differentiable"],
)
def test_settings_torch_xla_cannot_run_are_refused_up_front(
    make: Opt, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ExportError, match=message):
        export(_recipe(make, {"lr": 0.01, **kwargs})(), "/nonexistent/x.stepbundle")


@pytest.mark.parametrize("case", ["Adagrad", "NAdam capturable", "Adafactor"])
def test_the_users_optimizer_is_left_as_it_was(case: str, tmp_path: Path) -> None:
    import torch.compiler
    import torch.optim._adafactor as adafactor_module

    make, kwargs = CASES[case]
    r = _recipe(make, kwargs)()
    groups = [dict(g) for g in r.optimizer.param_groups]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in r.optimizer.state.items()}
    single = adafactor_module._single_tensor_adafactor
    export(r, tmp_path / "x.stepbundle")
    assert [dict(g) for g in r.optimizer.param_groups] == groups  # foreach put back
    assert {id(p) for p in r.optimizer.state} == set(state)  # no state made up on the user's
    for p, s in r.optimizer.state.items():
        for k, v in s.items():
            assert v.device.type == "cpu" and torch.equal(v, state[id(p)][k])
    assert not torch.compiler.is_compiling()
    assert adafactor_module._single_tensor_adafactor is single
    assert not r.optimizer._optimizer_step_pre_hooks and not r.optimizer._optimizer_step_post_hooks
