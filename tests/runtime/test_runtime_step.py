"""Trainer.step: batch checks before dispatch, donation, lazy metrics, seeds, run()."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import BindingError, LoadOptions, StateOptions, load
from stepbundle.schema import BundleError
from stepbundle.schema.rng import TORCH_XLA_MARK_STEP, advance_seed


@pytest.fixture
def linear():
    return load(golden_bundle("linear_adamw"))


def test_binding_error_is_a_bundle_error() -> None:
    assert issubclass(BindingError, BundleError)


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda b: {**b, "x": b["x"].astype(np.float64)}, "Dtype mismatch for batch input 'x'"),
        (lambda b: {**b, "x": b["x"][:3]}, "Shape mismatch for batch input 'x'"),
        (lambda b: {"x": b["x"]}, "Missing batch input(s): y"),
        (lambda b: {**b, "z": b["x"]}, "Unexpected batch input(s): z"),
        (lambda b: {**b, "y": b["y"].reshape(-1)}, "Shape mismatch for batch input 'y'"),
    ],
)
def test_rejected_batch_loses_nothing(linear, mutate, expect: str) -> None:
    batches = golden_batches("linear_adamw")
    reference = load(golden_bundle("linear_adamw"))
    ref_losses = [float(reference.step(b)["loss"]) for b in batches[:2]]

    linear.step(batches[0])
    with pytest.raises(BindingError) as err:
        linear.step(mutate(batches[1]))
    msg = str(err.value)
    assert expect in msg
    assert "expected: {x: f32[8,5], y: f32[8,3]}" in msg  # lists what the bundle takes
    assert "got:" in msg
    assert linear.step_count == 1
    # The next good call gives exactly what it gives when the bad call never happened.
    assert float(linear.step(batches[1])["loss"]) == ref_losses[1]
    for k, v in reference.state_dict().items():
        np.testing.assert_array_equal(linear.state_dict()[k], v, err_msg=k)


def test_unknown_entry_and_non_mapping_batch(linear) -> None:
    with pytest.raises(BindingError, match="has no 'predict' entry"):
        linear.evaluate(golden_batches("linear_adamw")[0], entry="predict")
    with pytest.raises(BindingError, match="dict of name -> array"):
        linear.step([1, 2, 3])  # type: ignore[arg-type]


def test_state_buffers_are_donated() -> None:
    t = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(state=StateOptions(pack_state=False)),
    )
    before = list(t._store.buffers)
    t.step(golden_batches("linear_adamw")[0])
    idx = {n: i for i, n in enumerate(t.state_names)}
    # Parameters and optimizer state are read and rewritten: their old buffers were
    # donated to the step's outputs.
    for name in ("weight", "bias", "optimizer.state.weight.exp_avg", "optimizer.state.weight.step"):
        assert before[idx[name]].is_deleted(), name
    # The new buffers are live.
    assert not any(a.is_deleted() for a in t._store.buffers)


def test_packed_state_buffers_are_donated(linear) -> None:
    # Packed (the default): the f32 pack holds every small tensor the step reads; it is
    # donated to its own update like any state buffer.
    names = linear._store.layout.buffer_names
    assert "pack.f32" in names
    pack = linear._store.layout.packs[0]
    assert {"weight", "bias", "optimizer.state.weight.exp_avg"} <= {m.state for m in pack.members}
    before = list(linear._store.buffers)
    linear.step(golden_batches("linear_adamw")[0])
    assert before[names.index("pack.f32")].is_deleted()
    plan = linear._router.plans["train"][0]
    assert len(plan.compiled.program.inputs) < 10  # 1 pack + 2 batch + constants


@pytest.mark.parametrize("name", ["linear_adamw", "dropout_sgd", "batchnorm_lr"])
def test_packing_changes_nothing_but_speed(name: str) -> None:
    batches = golden_batches(name)
    packed = load(golden_bundle(name))
    plain = load(
        golden_bundle(name),
        options=LoadOptions(state=StateOptions(pack_state=False)),
    )
    assert packed._store.layout.packs and not plain._store.layout.packs
    a = [float(m["loss"]) for m in packed.run(batches, 4)]
    b = [float(m["loss"]) for m in plain.run(batches, 4)]
    assert a == b
    pa, pb = packed.state_dict(), plain.state_dict()
    assert list(pa) == list(pb)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    # Loading state back into packed buffers round-trips.
    packed.load_state_dict(pb)
    for k, v in packed.state_dict().items():
        np.testing.assert_array_equal(v, pb[k], err_msg=k)


def test_packed_members_are_read_at_offsets_xla_cannot_fold() -> None:
    """The packing wrapper's offsets survive XLA's optimizations as runtime values
    (packing._opaque_offsets says why: constant offsets made every kernel distinct and
    the cold compile of a deep model ~6-8x slower). If XLA learns to fold them, the
    members are read by static slices again, and this fails before the compile times
    show it."""
    packed = load(golden_bundle("batchnorm_lr"))
    plain = load(
        golden_bundle("batchnorm_lr"),
        options=LoadOptions(state=StateOptions(pack_state=False)),
    )
    members = len(packed._store.layout.packs[0].members)
    assert members >= 4

    def hlo(t: Any) -> str:
        text: str = t._router.plans["train"][0].executable.hlo_modules()[0].to_string()
        return text

    optimized = hlo(packed)
    assert " while(" in optimized  # the one-trip loop the offsets come out of
    # The wrapper adds no static slice: each member is a dynamic-slice whose offset is
    # an operand, not a constant.
    assert optimized.count(" slice(") == hlo(plain).count(" slice(")
    reads = re.findall(r"dynamic-slice\(%[\w.\-]+, (%[\w.\-]+)\)", optimized)
    assert len(reads) >= members
    assert not [r for r in reads if r.startswith("%constant")]


def test_evaluate_donates_nothing(linear) -> None:
    before = list(linear._store.buffers)
    linear.evaluate(golden_batches("linear_adamw")[0])
    assert not any(a.is_deleted() for a in before)


def test_metrics_are_device_arrays_read_on_demand(linear) -> None:
    m = linear.step(golden_batches("linear_adamw")[0])
    assert isinstance(m["loss"], jax.Array)
    assert np.isfinite(float(m["loss"]))


def test_device_arrays_are_accepted_as_batches(linear) -> None:
    batches = golden_batches("linear_adamw")
    reference = load(golden_bundle("linear_adamw"))
    on_device = {k: jax.device_put(v, linear.device) for k, v in batches[0].items()}
    assert float(linear.step(on_device)["loss"]) == float(reference.step(batches[0])["loss"])


def test_run_equals_stepping_one_by_one() -> None:
    batches = golden_batches("dropout_sgd")
    a = load(golden_bundle("dropout_sgd"))
    b = load(golden_bundle("dropout_sgd"))
    seen: list[int] = []
    run_losses = [float(m["loss"]) for m in a.run(batches, 7, on_step=lambda i, m: seen.append(i))]
    step_losses = [float(b.step(batches[i % len(batches)])["loss"]) for i in range(7)]
    assert run_losses == step_losses
    assert seen == list(range(7))
    assert a.step_count == b.step_count == 7
    assert a.seed == b.seed


def test_seed_follows_torch_xla_rule() -> None:
    # Values read from torch_xla 2.9: the default seed 101 becomes 709230394 after one
    # mark_step, then 4973168205254853; the rule wraps modulo 2**64.
    assert advance_seed(TORCH_XLA_MARK_STEP, 101) == 709230394
    assert advance_seed(TORCH_XLA_MARK_STEP, 101, 2) == 4973168205254853
    s = 2**64 - 1
    assert advance_seed(TORCH_XLA_MARK_STEP, s) == (1012031 + s * 7012063) % 2**64
    t = load(golden_bundle("dropout_sgd"))
    assert t.manifest.rng is not None and t.manifest.rng.rule == TORCH_XLA_MARK_STEP
    assert t.seed == 12345
    t.step(golden_batches("dropout_sgd")[0])
    assert t.seed == advance_seed(TORCH_XLA_MARK_STEP, 12345)


def test_setting_the_seed_replays_dropout_masks() -> None:
    batches = golden_batches("dropout_sgd")
    a = load(golden_bundle("dropout_sgd"))
    b = load(golden_bundle("dropout_sgd"))
    c = load(golden_bundle("dropout_sgd"))
    c.seed = 999
    la = [float(a.step(x)["loss"]) for x in batches]
    lb = [float(b.step(x)["loss"]) for x in batches]
    lc = [float(c.step(x)["loss"]) for x in batches]
    assert la == lb
    assert la != lc  # a different seed draws different dropout masks
    with pytest.raises(BindingError, match="seed must be an integer"):
        a.seed = -1
    with pytest.raises(BindingError, match="no seed to set"):
        load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(),
        ).seed = 3


def test_hyperparameters_set_and_schedule(linear) -> None:
    t = load(golden_bundle("batchnorm_lr"))
    assert t.hyperparameters == {"lr": pytest.approx(0.01)}
    batches = golden_batches("batchnorm_lr")
    frozen = load(golden_bundle("batchnorm_lr"))
    # An lr of exactly 0 is refused for capturable Adam (0/0 in its update); a tiny one
    # leaves the float32 weights where they were: the hyperparameter reaches the graph.
    with pytest.raises(BindingError, match="capturable Adam/AdamW, whose update with an lr"):
        frozen.set_hyperparameter("lr", 0.0)
    frozen.set_hyperparameter("lr", 1e-30)
    w0 = frozen.state_dict()["0.weight"]
    frozen.step(batches[0])
    np.testing.assert_array_equal(frozen.state_dict()["0.weight"], w0)
    seen = []
    t.set_schedule("lr", lambda step: seen.append(step) or 0.001 * (step + 1))
    t.run(batches, 3)
    assert seen == [0, 1, 2]
    assert t.hyperparameters["lr"] == pytest.approx(0.003)
    with pytest.raises(BindingError, match="no hyperparameter 'momentum'"):
        t.set_hyperparameter("momentum", 0.5)
    with pytest.raises(BindingError, match="must be finite"):
        t.set_hyperparameter("lr", float("nan"))
    with pytest.raises(BindingError, match="no hyperparameter 'lr'"):
        linear.set_hyperparameter("lr", 0.1)


def test_run_can_drop_metrics_for_long_runs() -> None:
    t = load(golden_bundle("dropout_sgd"))
    seen: list[float] = []
    out = t.run(
        golden_batches("dropout_sgd"),
        5,
        on_step=lambda i, m: seen.append(float(m["loss"])),
        keep_metrics=False,
    )
    assert len(out) == 1 and float(out[0]["loss"]) == seen[-1]
    assert len(seen) == 5 and t.step_count == 5


def test_single_pass_result_handling_is_active(linear) -> None:
    # Both supported jaxlib versions offer the handler API; the slow fallback would
    # double the host cost of every output.
    plan = linear._router.plans["train"][0]
    assert plan.dispatch._handlers is not None
    assert len(plan.dispatch._handlers) == len(plan.compiled.program.outputs)
