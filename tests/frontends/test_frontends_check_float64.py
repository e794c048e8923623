"""The export check's float64 arbiter, stepped for the failing parameters alone (#39 item 2):
it computes what the whole float64 step computes for them, and declines (the whole step
then runs) where leaving the other parameters' gradients out changes them.

No export and no runtime: the eager steps themselves, on a small attention model whose
key bias gets a gradient that is zero in exact arithmetic (the kind of tensor that needs
the arbiter on GPT-2 small).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stepbundle.frontend.recipe import Recipe
from stepbundle.frontend.step_eager import CPU_EAGER, _copies, _eager, _float64_for, _to_float64


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(idx)).split(8, dim=-1)
        return self.head((q @ k.transpose(-1, -2) / 8**0.5).softmax(-1) @ v)


def _recipe(clip: float | None) -> Recipe:
    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(batch["idx"]).flatten(0, 1), batch["y"].flatten())
        loss.backward()
        if clip is not None:  # couples every parameter's update to every gradient
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return {"loss": loss}

    torch.manual_seed(3)
    model = _Attention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 16, (2, 6))
    return Recipe(model, opt, step, {"idx": idx, "y": torch.roll(idx, -1, 1)})


def _whole_step(recipe: Recipe, float64: bool) -> dict[str, torch.Tensor]:
    model, opt = _copies(recipe)
    batch = (
        _to_float64(model, opt, dict(recipe.example_batch))
        if float64
        else dict(recipe.example_batch)
    )
    _, state, _ = _eager(CPU_EAGER, recipe, model, opt, batch, None)
    return state


def test_the_pruned_float64_step_is_the_whole_steps_for_the_failing_parameter() -> None:
    recipe = _recipe(clip=None)
    failing = {"qkv.bias", "optimizer.state.qkv.bias.exp_avg"}
    eager = _whole_step(recipe, float64=False)
    got = _float64_for(recipe, failing, ["loss"], eager, CPU_EAGER, dict(recipe.example_batch), None)  # fmt: skip
    assert got is not None
    _, s64 = got
    whole = _whole_step(recipe, float64=True)
    for name in failing:
        assert s64[name].dtype == torch.float64
        torch.testing.assert_close(s64[name], whole[name], rtol=1e-13, atol=1e-15)
    # The rest was left out: no gradient, no update.
    assert "head.weight.grad" not in s64 and "optimizer.state.head.weight.exp_avg" not in s64
    assert torch.equal(s64["head.weight"], recipe.model.head.weight.detach().double())
    assert not torch.equal(whole["head.weight"], s64["head.weight"])


def test_it_declines_where_a_clipped_norm_couples_the_parameters() -> None:
    recipe = _recipe(clip=1e-3)
    eager = _whole_step(recipe, float64=False)
    batch = dict(recipe.example_batch)
    assert _float64_for(recipe, {"qkv.bias"}, ["loss"], eager, CPU_EAGER, batch, None) is None
    # The same without clipping is accepted: the clipping is what declined it.
    plain = _recipe(clip=None)
    eager = _whole_step(plain, float64=False)
    assert _float64_for(plain, {"qkv.bias"}, ["loss"], eager, CPU_EAGER, batch, None) is not None


def test_it_declines_a_failing_metric_or_buffer() -> None:
    recipe = _recipe(clip=None)
    eager = _whole_step(recipe, float64=False)
    batch = dict(recipe.example_batch)
    assert _float64_for(recipe, {"loss"}, ["loss"], eager, CPU_EAGER, batch, None) is None
    assert (
        _float64_for(recipe, {"not.a.parameter"}, ["loss"], eager, CPU_EAGER, batch, None) is None
    )
