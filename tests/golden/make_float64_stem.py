"""Make the float64 golden of tests/runtime/test_cpu_numerics_stem.py, once (export env).

A BatchNorm CNN whose stem is convolution -> ReLU -> BatchNorm over 32 64x64 images, so
BatchNorm's statistics and its backward are sums of 131,072 values per channel of a
non-zero mean (ReLU's outputs), then two strided convolution -> BatchNorm -> ReLU blocks,
average pooling and a linear head; SGD nesterov with weight decay. Exported with the
torch_xla front-end, and trained by PyTorch on the CPU from the same state over four
distinct batches (tests/golden/hashed_batches.py: computed, not stored), in float64 (the
ground truth) and in float32 (how far PyTorch's own float32 kernels are from it), 4 steps.
Written to tests/golden/float64/:

- ``bn_stem.stepbundle``: the bundle (its state is the initial state);
- ``bn_stem.float64.npz``: for every floating state tensor NAME (gradients aside), ``float64:NAME`` and
  ``float32:NAME`` (after 4 steps) and, where it exists before the first step,
  ``init:NAME`` (the initial value), and
  ``loss_float64`` / ``loss_float32``, one value per step.

Plain .npz arrays, no pickle. Refuses to overwrite: made once; the lean environment (no
torch) reads it, and nothing in the test that reads it shares code with the runtime.

Usage: .venv/bin/python tests/golden/make_float64_stem.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
os.environ.setdefault("PJRT_DEVICE", "CPU")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hashed_batches import hashed_batches  # noqa: E402
from make_float64 import classify  # noqa: E402
from support import train_eager_cpu  # noqa: E402

from stepbundle.exporter import Recipe, export  # noqa: E402

TARGET = HERE / "float64"
NAME = "bn_stem"
STEPS = 4
BATCH, SHAPE, CLASSES = 32, (3, 64, 64), 10


def batches() -> list[dict[str, np.ndarray]]:
    return hashed_batches(STEPS, BATCH, SHAPE, CLASSES)


def recipe() -> Recipe:
    torch.manual_seed(0)
    nn = torch.nn
    w = 16
    model = nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1),
        nn.ReLU(),
        nn.BatchNorm2d(w),
        nn.Conv2d(w, 2 * w, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * w, CLASSES),
    )
    opt = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    first = batches()[0]
    example = {"x": torch.from_numpy(first["x"]), "y": torch.from_numpy(first["y"])}
    return Recipe(model=model, optimizer=opt, step=classify, example_batch=example)


def main() -> int:
    bundle = TARGET / f"{NAME}.stepbundle"
    if bundle.exists():
        print(f"Refused: {bundle} exists (made once, never regenerated).", file=sys.stderr)
        return 1
    TARGET.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=TARGET) as tmp:
        work = Path(tmp)
        # Exported first: an eager backward on the CPU before torch_xla's first one
        # leaves autograd without a queue for the XLA device (an internal assert).
        export(recipe(), work / bundle.name)
        arrays = _references()
        np.savez_compressed(work / f"{NAME}.float64.npz", **arrays)
        for p in work.iterdir():
            p.rename(TARGET / p.name)
    print("PyTorch float64 losses:", arrays["loss_float64"])
    f32_err = np.abs(arrays["loss_float32"] - arrays["loss_float64"]) / arrays["loss_float64"]
    print("PyTorch float32, relative:", f32_err)
    return 0


def _references() -> dict[str, np.ndarray]:
    data = batches()
    init = train_eager_cpu(recipe, data, 0).state
    f64 = train_eager_cpu(recipe, data, STEPS, float64=True)
    f32 = train_eager_cpu(recipe, data, STEPS)
    arrays: dict[str, np.ndarray] = {}
    for name, value in f64.state.items():
        # Gradients are not state a bundle keeps between steps.
        if np.issubdtype(value.dtype, np.floating) and not name.endswith(".grad"):
            arrays[f"float64:{name}"] = value
            arrays[f"float32:{name}"] = f32.state[name]
            if name in init:  # the optimizer's momentum is made by its first step
                arrays[f"init:{name}"] = init[name]
    arrays["loss_float64"] = f64.series("loss")
    arrays["loss_float32"] = f32.series("loss")
    return arrays


if __name__ == "__main__":
    sys.exit(main())
