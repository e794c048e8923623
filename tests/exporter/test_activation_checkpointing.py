"""Activation checkpointing: torch_xla's exports; torch's, and dropout inside, are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from export_helpers import check_equivalent, mse_step, regression_batch

from stepbundle.exporter import ExportError, Recipe, export

SEED = 77


class _Net(torch.nn.Module):
    def __init__(
        self, how: str, drop_inside: bool = False, drop: float = 0.0, preserve: bool = True
    ) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(5, 8)  # so the checkpointed segment's input needs grad
        inner: list[torch.nn.Module] = [torch.nn.Linear(8, 16), torch.nn.Tanh()]
        if drop_inside:
            inner.append(torch.nn.Dropout(0.3))
        self.seg = torch.nn.Sequential(*inner)
        self.drop = torch.nn.Dropout(drop)
        self.preserve = preserve
        self.out = torch.nn.Linear(16, 3)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        if self.how == "torch_xla":
            import torch_xla.utils.checkpoint as xla_checkpoint

            h = xla_checkpoint.checkpoint(
                self.seg, h, use_reentrant=True, preserve_rng_state=self.preserve
            )
        else:
            import torch.utils.checkpoint as torch_checkpoint

            h = torch_checkpoint.checkpoint(self.seg, h, use_reentrant=False)
        return self.out(self.drop(h))


def _recipe(
    how: str = "torch_xla", drop_inside: bool = False, drop: float = 0.0, preserve: bool = True
) -> Recipe:
    torch.manual_seed(0)
    model = _Net(how, drop_inside, drop, preserve)
    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        step=mse_step,
        example_batch=regression_batch(),
        seed=SEED,
    )


def test_torch_xla_checkpoint_exports_and_matches_eager(tmp_path: Path) -> None:
    m = check_equivalent(_recipe, tmp_path, steps=3, rtol=1e-6, name="ckpt")
    updated = {getattr(o, "state", None) for o in m.entries["train"].programs[0].outputs}
    assert {"seg.0.weight", "pre.weight"} <= updated  # the segment and what feeds it train


def test_torch_utils_checkpoint_is_refused_pointing_to_torch_xla() -> None:
    with pytest.raises(
        ExportError, match=r"uses torch\.utils\.checkpoint, which fails on XLA"
    ) as e:
        export(_recipe("torch"), "/nonexistent/x.stepbundle")
    assert "torch_xla.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)" in str(e.value)
    assert isinstance(e.value.__cause__, AttributeError)  # torch's own error is kept


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [
        ({"drop_inside": True}, " inside a checkpointed segment"),
        ({"drop": 0.2, "preserve": False}, ""),
        ({"drop": 0.2}, ""),
    ],
    ids=["inside", "outside-no-preserve", "outside-preserve"],
)
def test_dropout_with_torch_xla_checkpoint_is_refused(kwargs: dict, where: str) -> None:
    with pytest.raises(
        ExportError,
        match=rf"uses torch_xla\.utils\.checkpoint and random numbers \(dropout\){where}\. ",
    ):
        export(_recipe(**kwargs), "/nonexistent/x.stepbundle")


class _GradlessSegment(torch.nn.Module):
    """The checkpointed segment reads the batch directly, which needs no grad."""

    def __init__(self, fix: bool = False) -> None:
        super().__init__()
        self.seg = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh())
        self.out = torch.nn.Linear(8, 3)
        self.fix = fix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch_xla.utils.checkpoint as xla_checkpoint

        if self.fix:
            x = x.detach().requires_grad_()
        return self.out(xla_checkpoint.checkpoint(self.seg, x, use_reentrant=True))


def _gradless_recipe(fix: bool = False) -> Recipe:
    torch.manual_seed(0)
    model = _GradlessSegment(fix)
    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        step=mse_step,
        example_batch=regression_batch(),
        seed=SEED,
    )


def test_reentrant_segment_without_grad_inputs_loses_its_gradients_in_torch() -> None:
    # The behaviour the refusal below guards against, shown with torch itself on the CPU.
    import torch.utils.checkpoint as torch_checkpoint

    torch.manual_seed(0)
    seg = torch.nn.Linear(5, 8)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        y = torch_checkpoint.checkpoint(seg, torch.ones(2, 5), use_reentrant=True)
    assert not y.requires_grad
    assert seg.weight.grad is None


def test_reentrant_segment_without_grad_inputs_is_refused_with_the_fix() -> None:
    with pytest.raises(ExportError, match=r"receives no input that requires grad") as e:
        export(_gradless_recipe(), "/nonexistent/x.stepbundle")
    msg = str(e.value)
    assert "parameters (0.weight, 0.bias)" in msg
    assert "x.requires_grad_()" in msg


def test_reentrant_segment_whose_input_requires_grad_trains_its_parameters(
    tmp_path: Path,
) -> None:
    m = check_equivalent(
        lambda: _gradless_recipe(fix=True), tmp_path, steps=3, rtol=1e-6, name="rg"
    )
    updated = {getattr(o, "state", None) for o in m.entries["train"].programs[0].outputs}
    assert {"seg.0.weight", "seg.0.bias", "out.weight"} <= updated
