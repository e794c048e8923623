"""A classifier with BatchNorm and Dropout, AdamW, and a learning-rate schedule.

The schedule is declared (``hyperparameters=("lr",)``) instead of run inside the step,
so the bundle takes ``lr`` as a named input and the runtime drives it:

    stepbundle export examples/mlp_dropout_schedule.py:recipe -o mlp.stepbundle
    python examples/make_data.py examples/mlp_dropout_schedule.py:data mlp.npz 64
    stepbundle run mlp.stepbundle --steps 200 --data mlp.npz \\
        --lr-schedule warmup_cosine:peak=3e-3,warmup=20,total=200,min=1e-4
"""

from __future__ import annotations

import numpy as np
import torch

from stepbundle.exporter import Recipe


class Classifier(torch.nn.Module):
    def __init__(self, d_in: int = 20, width: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(d_in, width),
            torch.nn.BatchNorm1d(width),
            torch.nn.GELU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(width, width),
            torch.nn.GELU(),
        )
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.body(x))


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    logits = model(batch["x"])
    loss = torch.nn.functional.cross_entropy(logits, batch["label"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    accuracy = (logits.argmax(-1) == batch["label"]).float().mean()
    return {"loss": loss, "accuracy": accuracy}


def eval_step(model, batch):
    logits = model(batch["x"])
    return {
        "loss": torch.nn.functional.cross_entropy(logits, batch["label"]),
        "accuracy": (logits.argmax(-1) == batch["label"]).float().mean(),
    }


def recipe() -> Recipe:
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-3, weight_decay=0.01, capturable=True, foreach=False
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


def data(steps: int = 8, batch: int = 32):
    """Four Gaussian blobs in 20 dimensions: a task the classifier learns in ~100 steps."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 20)).astype(np.float32) * 2
    labels = rng.integers(0, 4, size=(steps, batch))
    x = centers[labels] + rng.normal(size=(steps, batch, 20)).astype(np.float32)
    return {"x": x.astype(np.float32), "label": labels.astype(np.int64)}
