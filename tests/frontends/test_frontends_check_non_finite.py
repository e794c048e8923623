"""The export check's comparison tells non-finite values apart: a NaN where the eager
step has an infinity, or an infinity of the other sign, is a different step (it passed
as agreeing before: only finite or not was compared). Runs once per environment (no
export; ``frontend_core/step_compare.py`` alone)."""

from __future__ import annotations

import math

import pytest
import torch

from stepbundle.frontend.step_compare import FLOAT32, describe, verdicts

INF, NAN = math.inf, math.nan


def _verdict(bundle: list[float], eager: list[float], *, metric: bool) -> tuple[float, str]:
    want = torch.tensor(eager)
    if metric:
        (v,) = verdicts(["loss"], [], ({"loss": {"values": bundle}}, {}), ({"loss": want}, {}), {}, FLOAT32)  # fmt: skip
    else:
        before = {"w": torch.zeros(len(eager))}
        (v,) = verdicts([], ["w"], ({}, {"w": torch.tensor(bundle)}), ({}, {"w": want}), before, FLOAT32)  # fmt: skip
    return v.ratio, describe(v)


@pytest.mark.parametrize("metric", [False, True], ids=["state", "metric"])
@pytest.mark.parametrize(
    ("bundle", "eager", "shown"),
    [
        ([1.0, NAN, 2.0], [1.0, INF, 2.0], "[1]: bundle nan, eager inf"),
        ([1.0, 2.0, -INF], [1.0, 2.0, INF], "[2]: bundle -inf, eager inf"),
        ([INF, 1.0, 5.0], [INF, 1.0, NAN], "[2]: bundle 5.0, eager nan"),
    ],
)
def test_different_non_finite_values_fail_naming_the_element(
    bundle: list[float], eager: list[float], shown: str, metric: bool
) -> None:
    ratio, text = _verdict(bundle, eager, metric=metric)
    assert ratio == math.inf
    assert text == ("loss" if metric else "w") + shown, text


@pytest.mark.parametrize("metric", [False, True], ids=["state", "metric"])
def test_the_same_non_finite_values_pass(metric: bool) -> None:
    ratio, _ = _verdict([NAN, INF, -INF, 1.0], [NAN, INF, -INF, 1.0], metric=metric)
    assert ratio <= 1.0


def test_a_metric_differing_where_both_are_finite_is_shown_there() -> None:
    ratio, text = _verdict([INF, 1.0, 3.0], [INF, 1.0, 2.0], metric=True)
    assert ratio > 1.0
    assert text == "loss[2]: bundle 3.0, eager 2.0", text  # one pair of brackets
