"""``from stepbundle import export, Recipe, load``: the face picks the torch_xla front-end
where it is installed, and the bundle it writes runs through the face's ``load``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch_xla

from stepbundle import LoadOptions, Recipe, choose_frontend, export, load
from stepbundle.runtime import CompileOptions

ROOT = Path(__file__).resolve().parents[2]


def _example() -> Recipe:
    spec = importlib.util.spec_from_file_location(
        "linear_adamw", ROOT / "examples" / "linear_adamw.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    recipe: Recipe = module.recipe()
    return recipe


def test_the_face_exports_with_torch_xla_here_and_loads_back(tmp_path: Path) -> None:
    import stepbundle.exporter
    import stepbundle.frontend.recipe

    assert Recipe is stepbundle.frontend.recipe.Recipe is stepbundle.exporter.Recipe
    assert choose_frontend() == ("torch_xla", "torch_xla is installed")
    torch.manual_seed(0)
    path = tmp_path / "linear.stepbundle"
    report = export(_example(), path)
    assert path.is_file() and report is not None
    from stepbundle.schema import open_bundle

    producer = open_bundle(path).manifest.producer
    assert (
        producer.torch_xla == torch_xla.__version__
        and producer.stepbundle == stepbundle.__version__
    )
    trainer = load(path, "cpu", LoadOptions(CompileOptions(cache_dir=False)))
    batch = {"x": np.ones((8, 5), np.float32), "y": np.zeros((8, 3), np.float32)}
    losses = [float(trainer.step(batch)["loss"]) for _ in range(3)]
    assert losses[2] < losses[0]  # AdamW at lr 0.05 on one batch: the loss falls
