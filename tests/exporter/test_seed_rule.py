"""The schema's seed rule is torch_xla's: checked against torch_xla itself, not a formula.

torch_xla's C++ advances the device seed at every step boundary as
``1012031 + seed * 7012063`` in uint64 arithmetic; its dynamo bridge's Python writes the
modulus as 2**64 - 1. The two differ only for seeds that wrap, so those are the ones
that settle which rule a bundle must name: set such a seed with torch_xla's RNG API,
run a step that draws random numbers, and read the seed torch_xla holds afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm

from stepbundle.schema import UnknownSeedRuleError, advance_seed
from stepbundle.schema.rng import TORCH_XLA_MARK_STEP

# Seeds whose product wraps 2**64 (where mod 2**64 and mod 2**64 - 1 disagree), the top
# of the range, and small ones that never wrap.
SEEDS = [2**64 - 1, 2**64 - 2, 2**63, 2**63 + 12345, 0xDEADBEEFCAFEF00D, 0, 1, 12345]


def _torch_xla_after_steps(seed: int, steps: int, *, draw: bool) -> int:
    """The seed torch_xla holds after ``steps`` steps from ``seed``."""
    device = torch_xla.device()
    previous = xm.get_rng_state()
    xm.set_rng_state(seed)
    try:
        for _ in range(steps):
            if draw:  # a step that consumes randomness, as a dropout step does
                torch.rand(4, device=device).sum().item()
            torch_xla.sync()
        return int(xm.get_rng_state())
    finally:
        xm.set_rng_state(previous)


@pytest.mark.parametrize("seed", SEEDS)
def test_one_step_matches_torch_xla(seed: int) -> None:
    assert advance_seed(TORCH_XLA_MARK_STEP, seed, 1) == _torch_xla_after_steps(seed, 1, draw=True)


def test_the_rule_wraps_modulo_2_64_not_2_64_minus_1() -> None:
    # The seed where the two moduli disagree: torch_xla's answer decides.
    seed = 2**64 - 1
    got = _torch_xla_after_steps(seed, 1, draw=True)
    assert got == advance_seed(TORCH_XLA_MARK_STEP, seed, 1)
    assert got != (1012031 + seed * 7012063) % (2**64 - 1)


@pytest.mark.parametrize("seed", [2**64 - 1, 2**63 + 7])
def test_several_steps_match_torch_xla(seed: int) -> None:
    for steps in (0, 2, 5):
        want = _torch_xla_after_steps(seed, steps, draw=steps % 2 == 0)
        assert advance_seed(TORCH_XLA_MARK_STEP, seed, steps) == want, steps


def test_a_step_without_random_numbers_advances_the_seed_the_same_way() -> None:
    seed = 2**64 - 3
    assert _torch_xla_after_steps(seed, 1, draw=False) == advance_seed(TORCH_XLA_MARK_STEP, seed, 1)


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(UnknownSeedRuleError, match="'philox' is unknown") as info:
        advance_seed("philox", 1, 1)
    assert info.value.rule == "philox"


@pytest.mark.parametrize("seed", [2**64 - 1, 2**63 + 12345, 5])
@pytest.mark.parametrize("draws", [1, 3])
def test_draw_seed_is_torch_xla_running_state_after_random_ops(seed: int, draws: int) -> None:
    from stepbundle.schema.rng import draw_seed

    device = torch_xla.device()
    previous = xm.get_rng_state()
    xm.set_rng_state(seed)
    try:
        for _ in range(draws):
            torch.rand(4, device=device)
        got = int(xm.get_rng_state())
        torch_xla.sync()
    finally:
        xm.set_rng_state(previous)
    assert got == draw_seed(seed, draws)


@pytest.mark.parametrize("before", [0, 2])
def test_a_checkpoint_restore_advances_the_next_step_from_after_the_forward_draws(
    before: int,
) -> None:
    # torch_xla.utils.checkpoint's backward restores the state under xm.fork_rng, whose
    # exit sets it to the state the backward began with: the step rule then applies to
    # the seed after every forward draw (Rng.step_after_draws), not to the step's seed.
    import torch_xla.utils.checkpoint as xla_checkpoint

    device = torch_xla.device()
    seg = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).to(device)
    previous = xm.get_rng_state()
    seed = 2**63 + 99
    xm.set_rng_state(seed)
    try:
        x = torch.ones(2, 4, device=device, requires_grad=True)
        for _ in range(before):
            x = torch.nn.functional.dropout(x, 0.1)
        y = xla_checkpoint.checkpoint(seg, x, use_reentrant=True)
        y.sum().backward()
        torch_xla.sync()
        got = int(xm.get_rng_state())
    finally:
        xm.set_rng_state(previous)
    assert got == advance_seed(TORCH_XLA_MARK_STEP, seed, 1, before + 1)
    assert got != advance_seed(TORCH_XLA_MARK_STEP, seed, 1)


def test_a_step_that_sets_the_rng_state_itself_is_refused(tmp_path) -> None:
    """The step reseeds torch_xla every call: eager draws the same dropout mask each
    step, while a bundle advances its seed by the rule. Exported silently before (the
    one seed input took the rule); now refused, naming the calls to remove."""
    from export_helpers import regression_batch

    from stepbundle.exporter import ExportError, Recipe, export

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Dropout(0.5), torch.nn.Linear(6, 3))

    def step(model, optimizer, batch):
        xm.set_rng_state(1234)  # the same masks every step
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    recipe = Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        step=step,
        example_batch=regression_batch(),
    )
    with pytest.raises(ExportError, match="sets the RNG state itself"):
        export(recipe, tmp_path / "never.stepbundle")
    assert not (tmp_path / "never.stepbundle").exists()
