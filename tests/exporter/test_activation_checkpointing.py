"""Activation checkpointing: torch_xla's exports, with dropout inside or around it; torch's is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from export_helpers import check_equivalent, mse_step, regression_batch

from stepbundle.exporter import ExportError, Recipe, export

SEED = 77


class _Net(torch.nn.Module):
    def __init__(
        self,
        how: str,
        drop_inside: bool = False,
        drop: float = 0.0,
        preserve: bool = True,
        drop_before: float = 0.0,
    ) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(5, 8)  # so the checkpointed segment's input needs grad
        self.drop_before = torch.nn.Dropout(drop_before)
        inner: list[torch.nn.Module] = [torch.nn.Linear(8, 16), torch.nn.Tanh()]
        if drop_inside:
            inner.append(torch.nn.Dropout(0.3))
        self.seg = torch.nn.Sequential(*inner)
        self.drop = torch.nn.Dropout(drop)
        self.preserve = preserve
        self.out = torch.nn.Linear(16, 3)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop_before(self.pre(x))
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
    how: str = "torch_xla",
    drop_inside: bool = False,
    drop: float = 0.0,
    preserve: bool = True,
    drop_before: float = 0.0,
) -> Recipe:
    torch.manual_seed(0)
    model = _Net(how, drop_inside, drop, preserve, drop_before)
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
    ("kwargs", "restored", "after"),
    [
        ({"drop_inside": True}, (0,), 1),
        ({"drop_inside": True, "drop": 0.2}, (0,), 2),
        ({"drop_inside": True, "drop": 0.2, "drop_before": 0.1}, (1,), 3),
        ({"drop": 0.2, "preserve": False}, (), 1),
        ({"drop": 0.2}, (), 1),
    ],
    ids=["inside", "inside-and-after", "before-inside-after", "after-no-preserve", "after"],
)
def test_dropout_with_torch_xla_checkpoint_exports_and_matches_eager(
    tmp_path: Path, kwargs: dict, restored: tuple[int, ...], after: int
) -> None:
    # Each dropout is one draw. The recomputation restores the RNG state the segment's
    # forward began with: K = the draws before it (dropout before the segment). Leaving
    # torch_xla's fork_rng sets the state the backward began with, after all N forward
    # draws, and the next step's seed is the step rule applied to that. Eager torch_xla
    # is the oracle: a wrong K changes the recomputed masks (the gradients), a wrong N
    # every step's seed after the first.
    m = check_equivalent(
        lambda: _recipe(**kwargs), tmp_path, steps=5, seed=SEED, rtol=1e-6, name="ckpt-drop"
    )
    assert m.rng is not None
    assert m.rng.restored_after_draws == restored
    assert m.rng.step_after_draws == after
    assert ("rng_restored_draws" in m.required_features) == (after != 0)
    seeds = [i for i in m.entries["train"].programs[0].inputs if i.kind.value == "rng_seed"]
    assert len(seeds) == 1  # one seed input; the restored seed is derived in the program


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
