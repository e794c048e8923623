"""advance_seed applies the rule the manifest names; unknown rules and bad seeds are refused.

That the rule is torch_xla's own is checked against torch_xla in
tests/exporter/test_seed_rule.py; here: its fast path agrees with one step at a time.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepbundle.schema import BundleError, Rng, UnknownSeedRuleError, advance_seed
from stepbundle.schema.rng import SEED_RULES, TORCH_XLA_MARK_STEP, draw_seed


def test_every_rule_the_manifest_can_name_is_known() -> None:
    assert Rng(seed=0).rule in SEED_RULES
    assert TORCH_XLA_MARK_STEP == "torch_xla.mark_step"


@given(st.integers(0, 2**64 - 1), st.integers(0, 300))
def test_many_steps_equal_one_step_at_a_time(seed: int, steps: int) -> None:
    one_at_a_time = seed
    for _ in range(steps):
        one_at_a_time = advance_seed(TORCH_XLA_MARK_STEP, one_at_a_time)
    assert advance_seed(TORCH_XLA_MARK_STEP, seed, steps) == one_at_a_time
    assert 0 <= one_at_a_time < 2**64


def test_known_values() -> None:
    # torch_xla reported these (tests/exporter/test_seed_rule.py checks them live).
    assert advance_seed(TORCH_XLA_MARK_STEP, 0) == 1012031
    assert advance_seed(TORCH_XLA_MARK_STEP, 2**64 - 1) == 18446744073703551584
    assert advance_seed(TORCH_XLA_MARK_STEP, 2**63) == 9223372036855787839
    assert advance_seed(TORCH_XLA_MARK_STEP, 5, 0) == 5


def test_a_huge_step_count_is_fast() -> None:
    assert 0 <= advance_seed(TORCH_XLA_MARK_STEP, 1, 10**18) < 2**64


def test_an_unknown_rule_is_a_typed_error() -> None:
    with pytest.raises(UnknownSeedRuleError) as info:
        advance_seed("numpy.pcg64", 1)
    assert isinstance(info.value, BundleError)
    assert info.value.rule == "numpy.pcg64"
    assert "'torch_xla.mark_step'" in str(info.value)


@pytest.mark.parametrize(("seed", "steps"), [(-1, 1), (2**64, 1), (0, -1)])
def test_out_of_range_is_refused(seed: int, steps: int) -> None:
    with pytest.raises(ValueError):
        advance_seed(TORCH_XLA_MARK_STEP, seed, steps)


def _draw_once(x: int) -> int:
    # torch_xla's per-op seed update, restated here as the oracle.
    return (2531011 + 214013 * x) % 2**64


def _mark_once(x: int) -> int:
    return (1012031 + x * 7012063) % 2**64


@given(st.integers(0, 2**64 - 1), st.integers(0, 300))
def test_draw_seed_equals_one_draw_at_a_time(seed: int, draws: int) -> None:
    x = seed
    for _ in range(draws):
        x = _draw_once(x)
    assert draw_seed(seed, draws) == x


@given(st.integers(0, 2**64 - 1), st.integers(0, 60), st.integers(0, 40))
def test_steps_after_draws_equal_draws_then_the_rule_each_step(
    seed: int, steps: int, draws: int
) -> None:
    x = seed
    for _ in range(steps):
        for _ in range(draws):
            x = _draw_once(x)
        x = _mark_once(x)
    assert advance_seed(TORCH_XLA_MARK_STEP, seed, steps, draws) == x


def test_known_draw_values() -> None:
    # torch_xla reported these: xm.set_rng_state(5), then one and two dropouts, then
    # one dropout and a mark_step after a checkpoint's restore (tests/exporter checks live).
    assert draw_seed(5, 1) == 3601076
    assert draw_seed(5, 2) == 770679608999
    assert advance_seed(TORCH_XLA_MARK_STEP, 5, 1, 2) == 5404053971117366968


def test_negative_draws_are_refused() -> None:
    with pytest.raises(ValueError, match="0 or more"):
        draw_seed(1, -1)
    with pytest.raises(ValueError, match="0 or more"):
        advance_seed(TORCH_XLA_MARK_STEP, 1, 1, -1)
