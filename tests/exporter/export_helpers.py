"""Helpers for the exporter tests: export a recipe and check it against torch_xla eager."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from support import assert_runs_close, make_batches, run_bundle_inprocess, train_eager_xla
from support import mse_step as mse_step  # the exporter tests' name for it

from stepbundle.exporter import Recipe, export
from stepbundle.schema import Manifest, open_bundle


def regression_batch(
    n: int = 8, d_in: int = 5, d_out: int = 3, seed: int = 0
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, d_in, generator=g), "y": torch.randn(n, d_out, generator=g)}


def linear_sgd_recipe(step: Callable[..., Any], lr: float = 0.1) -> Recipe:
    """Linear(5, 3) trained by ``step`` with plain SGD on a regression batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        step=step,
        example_batch=regression_batch(),
    )


def check_equivalent(
    recipe_fn: Callable[[], Any],
    tmp_path: Path,
    *,
    steps: int = 3,
    seed: int | None = None,
    schedule: Callable[[int], float] | None = None,
    rtol: float = 1e-5,
    name: str = "bundle",
) -> Manifest:
    """Export ``recipe_fn()``, run it ``steps`` steps, compare with torch_xla eager.

    Every metric at every step and every state tensor at the end must agree to
    ``rtol`` (relative to each tensor's scale). Returns the bundle's manifest.
    """
    path = tmp_path / f"{name}.stepbundle"
    recipe = recipe_fn()
    export(recipe, path)
    batches = make_batches(recipe, 3)
    ref = train_eager_xla(recipe_fn, batches, steps, seed=seed, schedule=schedule)
    got = run_bundle_inprocess(path, batches, steps, seed=seed, schedule=schedule)
    assert_runs_close(got, ref, rtol=rtol, what=name)
    # Training moved: the bundle's state is written back between steps.
    losses = got.series("loss")
    assert losses[0] != losses[-1] or steps == 1
    with open_bundle(path) as b:
        return b.manifest
