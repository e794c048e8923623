"""K steps per call on a model with convolutions: bit for bit K single steps.

The golden bundles have no convolution. Inside the K-step loop XLA:CPU would not put a
convolution in its fast kernels' order (it does so only in the entry computation), and
a small CNN's loss came out 1 ulp apart from the single step's at step 1; the runtime
now reorders them itself (stablehlo/conv_layout.py). Exported here with torch_xla, run
by the runtime in this process (jax 0.7.1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from stepbundle.exporter import Recipe, export
from stepbundle.runtime import CompileOptions, LoadOptions, load

K = 4


def _cnn_recipe() -> Recipe:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.Conv2d(4, 4, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 3),
    )

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    g = torch.Generator().manual_seed(1)
    return Recipe(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True, foreach=False),
        step=step,
        example_batch={
            "x": torch.randn(8, 1, 8, 8, generator=g),
            "y": torch.randint(0, 3, (8,), generator=g),
        },
    )


def test_a_cnn_runs_k_steps_per_call_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "cnn.stepbundle"
    export(_cnn_recipe(), path)
    rng = np.random.default_rng(2)
    batches = [
        {
            "x": rng.normal(size=(8, 1, 8, 8)).astype(np.float32),
            "y": rng.integers(0, 3, 8).astype(np.int64),
        }
        for _ in range(2 * K)
    ]
    one = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    many = load(
        path, options=LoadOptions(compile=CompileOptions(cache_dir=False, steps_per_call=K))
    )
    m_one = [float(np.asarray(m["loss"])) for m in one.run(batches, 2 * K)]
    m_many = [float(np.asarray(m["loss"])) for m in many.run(batches, 2 * K)]
    assert f"train[0]x{K}" in many.load_info.cache  # the K-step program ran
    assert m_many == m_one
    a, b = one.state_dict(), many.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
