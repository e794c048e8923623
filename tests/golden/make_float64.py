"""Make the float64 golden files of tests/runtime/test_cpu_numerics.py, once (export env).

A BatchNorm CNN (three convolutions, each followed by BatchNorm and ReLU, average
pooling, a linear head; SGD nesterov with weight decay), exported with the torch_xla
front-end, with four distinct batches, and PyTorch's own training of it from the same
state on the same batches, in float64 (the ground truth) and in float32 (how far
PyTorch's own float32 kernels are from it), 8 steps. Written to tests/golden/float64/:

- ``bn_cnn.stepbundle``: the bundle;
- ``bn_cnn.inputs.npz``: one (S, *shape) array per batch input;
- ``bn_cnn.float64.npz``: ``loss_float64`` and ``loss_float32``, one value per step.

Plain .npz arrays, no pickle. Refuses to overwrite: like the format goldens, these are
made once; the lean environment (no torch) reads them, and nothing in the test that
reads them shares code with the runtime.

Usage: .venv/bin/python tests/golden/make_float64.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]
os.environ.setdefault("PJRT_DEVICE", "CPU")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from support import make_batches, save_batches, train_eager_cpu  # noqa: E402

from stepbundle.exporter import Recipe, export  # noqa: E402

TARGET = HERE / "float64"
NAME = "bn_cnn"
STEPS = 8
N_BATCHES = 4


def classify(model, optimizer, batch):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def recipe() -> Recipe:
    torch.manual_seed(0)
    nn = torch.nn
    w = 16
    model = nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(),
        nn.Conv2d(w, 2 * w, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * w, 10),
    )
    opt = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    g = torch.Generator().manual_seed(7)
    return Recipe(
        model=model,
        optimizer=opt,
        step=classify,
        example_batch={"x": torch.randn(16, 3, 32, 32, generator=g), "y": torch.arange(16) % 10},
    )


def main() -> int:
    bundle = TARGET / f"{NAME}.stepbundle"
    if bundle.exists():
        print(f"Refused: {bundle} exists (made once, never regenerated).", file=sys.stderr)
        return 1
    TARGET.mkdir(exist_ok=True)
    batches = make_batches(recipe(), N_BATCHES)
    with tempfile.TemporaryDirectory(dir=TARGET) as tmp:
        work = Path(tmp)
        export(recipe(), work / bundle.name)
        save_batches(batches, work / f"{NAME}.inputs.npz")
        f64 = train_eager_cpu(recipe, batches, STEPS, float64=True).series("loss")
        f32 = train_eager_cpu(recipe, batches, STEPS).series("loss")
        np.savez(work / f"{NAME}.float64.npz", loss_float64=f64, loss_float32=f32)
        for p in work.iterdir():
            p.rename(TARGET / p.name)
    print("PyTorch float64 losses:", f64)
    print("PyTorch float32, relative:", np.abs(f32 - f64) / f64)
    return 0


if __name__ == "__main__":
    sys.exit(main())
