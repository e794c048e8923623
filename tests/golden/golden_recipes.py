"""The recipes behind the committed golden bundles (tests/golden/*.stepbundle).

Tiny on purpose: each golden bundle, its inputs and its expected outputs are committed,
and every test run loads and runs them. Regenerate with
``.venv/bin/python tests/golden/make_golden.py`` — only when a format change is
intended (a new major version), since changing them hides format breaks.
"""

from __future__ import annotations

import torch

from stepbundle.exporter import Recipe


def _mse_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _mse_eval(model, batch):
    pred = model(batch["x"])
    return {"loss": torch.nn.functional.mse_loss(pred, batch["y"]), "pred_mean": pred.mean()}


def linear_adamw() -> Recipe:
    """The reported case, with a short-last-batch bucket and an eval entry."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, capturable=True, foreach=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, generator=g)
    y = torch.randn(8, 3, generator=g)
    return Recipe(
        model=model,
        optimizer=opt,
        step=_mse_step,
        example_batch={"x": x, "y": y},
        example_batches=[{"x": x[:5], "y": y[:5]}],
        eval_step=_mse_eval,
    )


class _DropoutMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _ce_step(model, optimizer, batch):
    optimizer.zero_grad()
    logits = model(batch["x"])
    loss = torch.nn.functional.cross_entropy(logits, batch["label"])
    loss.backward()
    optimizer.step()
    acc = (logits.argmax(-1) == batch["label"]).float().mean()
    return {"loss": loss, "accuracy": acc}


def dropout_sgd() -> Recipe:
    """Dropout (an RNG seed input) with SGD momentum, nesterov and weight decay."""
    torch.manual_seed(0)
    model = _DropoutMLP()
    opt = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
    )
    g = torch.Generator().manual_seed(2)
    return Recipe(
        model=model,
        optimizer=opt,
        step=_ce_step,
        example_batch={
            "x": torch.randn(16, 6, generator=g),
            "label": torch.randint(0, 4, (16,), generator=g),
        },
        seed=12345,
    )


def batchnorm_lr() -> Recipe:
    """BatchNorm running statistics (buffers the step changes) and a declared lr."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        # Tanh before the BatchNorm: a bias right before BatchNorm has a gradient of
        # pure rounding noise, which Adam would amplify into noise-sized updates.
        torch.nn.Linear(4, 8),
        torch.nn.Tanh(),
        torch.nn.BatchNorm1d(8),
        torch.nn.Linear(8, 2),
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True, foreach=False)
    g = torch.Generator().manual_seed(3)
    return Recipe(
        model=model,
        optimizer=opt,
        step=_mse_step,
        example_batch={"x": torch.randn(10, 4, generator=g), "y": torch.randn(10, 2, generator=g)},
        hyperparameters=("lr",),
    )


GOLDEN = {
    "linear_adamw": linear_adamw,
    "dropout_sgd": dropout_sgd,
    "batchnorm_lr": batchnorm_lr,
}
# Per golden: steps, and the lr schedule (warmup_cosine spec) the run uses, if any.
RUNS = {
    "linear_adamw": {"steps": 5, "schedule": None},
    "dropout_sgd": {"steps": 5, "schedule": None},
    "batchnorm_lr": {"steps": 6, "schedule": "warmup_cosine:peak=0.02,warmup=2,total=6,min=0.001"},
}
