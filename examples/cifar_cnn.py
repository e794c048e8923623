"""A small CIFAR-sized CNN: 32x32x3 uint8 images, converted to float inside the step.

What a real image-classification step looks like, exported whole: conv/BatchNorm/ReLU
blocks, dropout, AdamW with two param groups (no weight decay on norms and biases),
label smoothing, gradient clipping (its norm reported), and an ``eval`` entry. The
learning rate is declared (``hyperparameters=("lr",)``), so with two groups the bundle
takes ``param_groups.0.lr`` and ``param_groups.1.lr`` and ``--lr-schedule`` drives both:

    stepbundle export examples/cifar_cnn.py:recipe -o cifar.stepbundle
    python examples/write_dataset.py train/ 10000      # images x: uint8[32,32,3], labels y
    stepbundle run cifar.stepbundle --data train/ --epochs 3 --until-step 468 \\
        --lr-schedule warmup_cosine:peak=3e-3,warmup=50,total=468,min=1e-5

``examples/train_cifar.sh`` runs the whole job (evaluation, TensorBoard, checkpoints,
resume). Images stay uint8 on disk and on the way to the device (4x less to read and
copy than float32); the step scales them. ``data`` makes batches whose labels can be
learnt from the pixels (``examples/make_data.py examples/cifar_cnn.py:data``).

Imports: torch, numpy, stepbundle.exporter.
"""

from __future__ import annotations

import numpy as np
import torch

from stepbundle.exporter import Recipe

BATCH = 64
CLASSES = 10
# Per-channel mean and standard deviation of uint8 pixels (CIFAR-10's, scaled to 0..255).
MEAN = (125.3, 123.0, 113.9)
STD = (63.0, 62.1, 66.7)


def conv_block(c_in: int, c_out: int) -> torch.nn.Sequential:
    """3x3 convolution (no bias: BatchNorm has one), BatchNorm, ReLU, 2x2 max-pool."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(c_out),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
    )


class CifarCnn(torch.nn.Module):
    """Three conv blocks (32 -> 16 -> 8 -> 4 pixels), global average pool, dropout, linear."""

    def __init__(self, widths: tuple[int, int, int] = (8, 16, 32), classes: int = CLASSES):
        super().__init__()
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1), persistent=False)
        a, b, c = widths
        self.features = torch.nn.Sequential(conv_block(3, a), conv_block(a, b), conv_block(b, c))
        self.drop = torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(c, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # uint8 NHWC, as stored on disk, to normalized float NCHW.
        x = (images.permute(0, 3, 1, 2).float() - self.mean) / self.std
        x = self.features(x).mean(dim=(2, 3))
        return self.head(self.drop(x))


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    logits = model(batch["x"])
    loss = torch.nn.functional.cross_entropy(logits, batch["y"], label_smoothing=0.1)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    accuracy = (logits.argmax(-1) == batch["y"]).float().mean()
    return {"loss": loss, "accuracy": accuracy, "grad_norm": grad_norm}


def eval_step(model, batch):
    logits = model(batch["x"])
    return {
        "loss": torch.nn.functional.cross_entropy(logits, batch["y"]),
        "accuracy": (logits.argmax(-1) == batch["y"]).float().mean(),
    }


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on conv and linear weights only, not on BatchNorm or biases."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def recipe() -> Recipe:
    torch.manual_seed(0)
    model = CifarCnn()
    optimizer = torch.optim.AdamW(
        param_groups(model, 5e-4), lr=3e-3, capturable=True, foreach=False
    )
    batch = {k: torch.from_numpy(v[0]) for k, v in data(1).items()}
    return Recipe(
        model=model,
        optimizer=optimizer,
        step=train_step,
        example_batch=batch,
        eval_step=eval_step,
        hyperparameters=("lr",),
        seed=2024,
    )


def labelled_images(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``rows`` noisy images whose label is where a bright 8x8 patch sits, and its colour.

    Label ``k`` puts the patch in cell ``k`` of a 4x4 grid over the image, tinted by one
    of three channels (``k % 3``): a CNN learns it in a few hundred steps, and the label
    is a function of the pixels, so the loss falls.
    """
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=rows)
    x = rng.integers(0, 160, size=(rows, 32, 32, 3), dtype=np.uint8)
    for k in range(CLASSES):
        rows_k = np.flatnonzero(y == k)
        r, c = divmod(k, 4)
        x[rows_k, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8, :] = 40
        x[rows_k, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8, k % 3] = 255
    return {"x": x, "y": y.astype(np.int64)}


def data(steps: int = 8, batch: int = BATCH) -> dict[str, np.ndarray]:
    """``steps`` batches of ``labelled_images``, stacked: x (steps, batch, 32, 32, 3)."""
    d = labelled_images(steps * batch)
    return {
        "x": d["x"].reshape(steps, batch, 32, 32, 3),
        "y": d["y"].reshape(steps, batch),
    }
