"""A step whose graph changes between the exporter's two traces is refused with what
changed: the metric keys, the input and output tables, and the first differing op with
the Python source location torch_xla recorded for it."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from export_helpers import linear_sgd_recipe

from stepbundle.exporter import ExportError, export


def _line_of(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if marker in ln)


def _refusal(step) -> str:
    with pytest.raises(ExportError, match="changed between two consecutive traced steps") as e:
        export(linear_sgd_recipe(step), "/nonexistent/x.stepbundle")
    msg = str(e.value)
    print(msg)
    assert "func.func @main" not in msg  # not a cut line of the printed module
    return msg


def test_an_op_added_every_other_step_is_named_with_its_source_line() -> None:
    calls = [0]

    def step(model, optimizer, batch):
        calls[0] += 1
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        if calls[0] % 2 == 0:
            loss = loss * 2  # the op that changes
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    msg = _refusal(step)
    line = _line_of(step, "the op that changes")
    # The Python 2 became a graph input of the second trace...
    assert (
        "input 0: a value captured from Python or made inside the step (float32[]) in step 2, "
        "not in step 1" in msg
    )
    # ... and the op using it is named, where the step computes it.
    pattern = rf"step 2 computes f32\[\] aten::mul\(%\d+, input\) at step@{__name__}\.py:{line}"
    assert re.search(pattern, msg), msg


def test_changed_metric_keys_are_named() -> None:
    calls = [0]

    def step(model, optimizer, batch):
        calls[0] += 1
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        out = {"loss": loss}
        if calls[0] % 2 == 0:
            out["half"] = loss / 2
        return out

    msg = _refusal(step)
    assert "metric keys: ['loss'] in step 1, ['loss', 'half'] in step 2" in msg
    assert "output 1: metric 'half' (float32[]) in step 2, not in step 1" in msg


def test_a_change_that_does_not_recur_shows_the_first_stablehlo_op() -> None:
    """The first call differs from every later one: tracing again to find the source
    location does not see it, and the StableHLO op is shown instead."""
    calls = [0]

    def step(model, optimizer, batch):
        calls[0] += 1
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        if calls[0] == 1:
            loss = loss.exp()
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    msg = _refusal(step)
    assert calls[0] == 4  # traced twice, then twice again with source locations
    assert "first differing StableHLO op (op " in msg
    assert re.search(r"step [12]: .*stablehlo\.exponential", msg), msg
