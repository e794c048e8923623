"""The equivalence suite's comparison itself: what it catches and what it allows.

Synthetic runs, no training: these run in well under a second.
"""

from __future__ import annotations

import numpy as np
import pytest
from equiv_harness import arbitrate, compare
from equiv_models import FP32_CPU, FP32_XLA
from support import Run


def _run(losses: list[float], **state: np.ndarray) -> Run:
    return Run([{"loss": v} for v in losses], {k: np.asarray(v) for k, v in state.items()})


def test_a_lost_update_is_caught_where_values_barely_move() -> None:
    """A weight that moves by 1e-6 of itself per step matches within 1e-5 even with its
    last update missing; the update comparison still sees a third of it missing."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(100)
    step = 1e-6 * rng.standard_normal(100)
    ref = _run([1.0], w=w0 + 3 * step)
    lost = _run([1.0], w=w0 + 2 * step)
    c = compare(lost, ref, FP32_XLA, "lost update", initial={"w": w0})
    assert c.worst_state < FP32_XLA.state_rtol  # the values alone would pass
    assert c.worst_update == pytest.approx(1 / 3, rel=1e-3)
    assert any("of its movement" in f for f in c.failures)


def test_rounding_level_differences_pass() -> None:
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(100)
    w = w0 + 1e-2 * rng.standard_normal(100)
    noisy = w * (1 + 1e-7 * rng.standard_normal(100))
    c = compare(_run([1.0], w=noisy), _run([1.0 + 1e-7], w=w), FP32_XLA, "ok", initial={"w": w0})
    assert not c.failures, c.failures


def test_nan_state_integer_state_and_metrics_fail() -> None:
    ref = _run([1.0, 0.5], w=np.ones(3), n=np.array(5))
    got = _run([1.0, 0.6], w=np.array([1.0, np.nan, 1.0]), n=np.array(4))
    failures = " ".join(compare(got, ref, FP32_XLA, "bad").failures)
    assert "step 1 metric loss" in failures
    assert "state w" in failures and "state n" in failures


def test_tied_names_are_compared_and_empty_placeholders_ignored() -> None:
    ref = _run([1.0], emb=np.ones(4))
    got = _run([1.0], emb=np.ones(4), head=np.ones(4), placeholder=np.zeros(0))
    assert not compare(got, ref, FP32_XLA, "tied", aliases={"head": "emb"}).failures
    wrong = _run([1.0], emb=np.ones(4), head=np.zeros(4))
    assert compare(wrong, ref, FP32_XLA, "untied", aliases={"head": "emb"}).failures
    assert compare(wrong, ref, FP32_XLA, "unknown name").failures  # head is not known


def _three_runs(
    xla_error: float, bundle_error: float
) -> tuple[Run, Run, Run, dict[str, np.ndarray]]:
    """float64 truth, then torch_xla and the bundle, each off it by its own error."""
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal(200)
    w = w0 + 1e-2 * rng.standard_normal(200)
    truth = _run([1.0, 0.9], w=w)
    off = rng.standard_normal(200)
    xla = _run([1.0, 0.9 * (1 + 1e-2 * xla_error)], w=w + xla_error * 1e-2 * off)
    bundle = _run([1.0, 0.9 * (1 - 1e-2 * bundle_error)], w=w - bundle_error * 1e-2 * off)
    return truth, xla, bundle, {"w": w0}


def test_float64_sides_with_the_bundle_when_torch_xla_is_off() -> None:
    """torch_xla 5% of the movement off float64, the bundle 1e-6: the disagreement is
    torch_xla's, so the arbiter finds nothing against the bundle."""
    truth, xla, bundle, w0 = _three_runs(xla_error=5e-2, bundle_error=1e-6)
    assert compare(bundle, xla, FP32_XLA, "off", initial=w0).failures
    assert arbitrate(bundle, xla, truth, FP32_XLA, FP32_CPU, {}, w0, "off") == []


def test_float64_does_not_excuse_a_wrong_bundle() -> None:
    # The bundle is the one 5% off: both the float64 bound and the nearer test catch it.
    truth, xla, bundle, w0 = _three_runs(xla_error=1e-6, bundle_error=5e-2)
    problems = " ".join(arbitrate(bundle, xla, truth, FP32_XLA, FP32_CPU, {}, w0, "wrong"))
    assert "against PyTorch float64" in problems
    assert "bundle is the farther from float64" in problems
    assert "the bundle is the farther one" in problems  # the loss at step 1
    # Both off by the same 3e-3 of the movement, on opposite sides: within the CPU bounds
    # of float64, yet the bundle is no nearer than torch_xla on the tensor, so it fails.
    truth, xla, bundle, w0 = _three_runs(xla_error=3e-3, bundle_error=3e-3 * (1 + 1e-9))
    problems = " ".join(arbitrate(bundle, xla, truth, FP32_XLA, FP32_CPU, {}, w0, "even"))
    assert "against PyTorch float64" not in problems
    assert "state w: bundle and torch_xla disagree" in problems


@pytest.mark.parametrize(
    ("bundle_rv", "excused"),
    [("written", True), ("not written back", False), ("twice", False)],
)
def test_the_arbiter_holds_running_variances_to_torch_xla(bundle_rv: str, excused: bool) -> None:
    """Float64 (PyTorch: the unbiased update) cannot arbitrate the running variances of a
    numerics="torch_xla" bundle (the biased update, as torch_xla's): the arbiter holds them
    to torch_xla's on their movement, so one not written back is never excused."""
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal(200)
    w = w0 + 1e-2 * rng.standard_normal(200)
    off = rng.standard_normal(200)
    rv = np.abs(rng.standard_normal(8)) + 1
    truth = Run([{"loss": 1.0}], {"w": w, "bn.running_var": rv * 8 / 7})
    xla = Run([{"loss": 1.0}], {"w": w + 5e-4 * off, "bn.running_var": rv})  # off on w
    got_rv = {"written": rv * (1 + 1e-5), "not written back": np.ones(8), "twice": rv * 2}
    bundle = Run([{"loss": 1.0}], {"w": w + 1e-8 * off, "bn.running_var": got_rv[bundle_rv]})
    initial = {"w": w0, "bn.running_var": np.ones(8)}
    assert compare(bundle, xla, FP32_XLA, "x", initial=initial).failures  # beyond the bounds
    problems = arbitrate(bundle, xla, truth, FP32_XLA, FP32_CPU, {}, initial, "x")
    assert (problems == []) == excused, problems
    assert all("running_var" in p for p in problems)
