"""K steps per dispatch (``CompileOptions(steps_per_call=K)``) are bit for bit K single steps.

The golden bundles cover the cases that could go wrong in the loop: AdamW state carried
through it (linear_adamw), a seed advanced per step for dropout (dropout_sgd), and a
scheduled learning rate with BatchNorm buffers (batchnorm_lr). Every metric of every
step and every state tensor must be equal, not close: each iteration runs the same
program on the same values as a single step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_helpers import (
    GOLDEN_DIR,
    GOLDEN_SCHEDULES,
    cli_here,
    golden_batches,
    golden_bundle,
)

from stepbundle.runtime import (
    BindingError,
    CompileOptions,
    LoadOptions,
    NonFiniteLossError,
    UsageError,
    load,
)
from stepbundle.runtime.errors import BatchStackError
from stepbundle.runtime.state.checkpoint import read_safetensors
from stepbundle.runtime.train.metrics import StepMetric

K = 4
STEPS = 11  # two calls of 4, then three single steps


def _pair(name: str, **kw: Any) -> tuple[Any, Any]:
    one = load(golden_bundle(name), options=LoadOptions.from_keywords(**kw))
    many = load(
        golden_bundle(name),
        options=LoadOptions.from_keywords(steps_per_call=K, **kw),
    )
    for t in (one, many):
        if name in GOLDEN_SCHEDULES:
            t.set_schedule("lr", GOLDEN_SCHEDULES[name])
    return one, many


def _first(name: str, n: int) -> list[dict[str, np.ndarray]]:
    """``n`` batches, cycling through the golden file's."""
    batches = golden_batches(name)
    return [batches[i % len(batches)] for i in range(n)]


def _assert_identical(one: Any, many: Any, m_one: list[Any], m_many: list[Any]) -> None:
    assert len(m_one) == len(m_many)
    for i, (a, b) in enumerate(zip(m_one, m_many)):
        assert sorted(a) == sorted(b)
        for k in a:
            np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]), err_msg=f"{k}@{i}")
    s_one, s_many = one.state_dict(), many.state_dict()
    assert sorted(s_one) == sorted(s_many)
    for k, v in s_one.items():
        np.testing.assert_array_equal(s_many[k], v, err_msg=k)
    assert many.step_count == one.step_count
    assert many.seed == one.seed
    assert many.hyperparameters == one.hyperparameters


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("name", ["linear_adamw", "dropout_sgd", "batchnorm_lr"])
def test_run_with_k_steps_per_call_is_bit_identical(name: str, pack: bool) -> None:
    one, many = _pair(name, pack_state=pack)
    batches = golden_batches(name)
    m_one = one.run(batches, STEPS)
    m_many = many.run(batches, STEPS)
    # The first 2K steps really ran as K-step calls, the tail one step at a time.
    assert all(isinstance(m["loss"], StepMetric) for m in m_many[: 2 * K])
    assert not any(isinstance(m["loss"], StepMetric) for m in m_many[2 * K :])
    assert f"train[0]x{K}" in many.load_info.cache
    _assert_identical(one, many, m_one, m_many)
    # The losses moved: the state was carried from iteration to iteration.
    losses = [float(m["loss"]) for m in m_many]
    assert len(set(losses)) > 1


def test_the_schedule_is_followed_per_step_inside_a_call() -> None:
    name = "batchnorm_lr"
    one, many = _pair(name)
    lrs_one: list[float] = []
    one.run(golden_batches(name), K, on_step=lambda i, m: lrs_one.append(one.hyperparameters["lr"]))
    many.run(golden_batches(name), K)
    # The warmup changes lr every step: a call that fed one lr to all K steps would
    # end with other state (checked bit for bit above); here, the last value is kept.
    assert len(set(lrs_one)) == K
    assert many.hyperparameters["lr"] == lrs_one[-1]


def test_step_many_matches_k_steps_and_returns_stacked_metrics() -> None:
    name = "dropout_sgd"
    one, many = _pair(name)
    batches = _first(name, K)
    stack = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    singles = [one.step(b) for b in batches]
    out = many.step_many(stack)
    for k in singles[0]:
        assert tuple(out[k].shape) == (K, *np.shape(singles[0][k]))
        np.testing.assert_array_equal(
            np.asarray(out[k]), np.stack([np.asarray(s[k]) for s in singles])
        )
    _assert_identical(one, many, [], [])
    # A K-step trainer still takes single steps.
    np.testing.assert_array_equal(
        np.asarray(many.step(batches[0])["loss"]), np.asarray(one.step(batches[0])["loss"])
    )


def test_a_stack_of_the_wrong_shape_is_refused_before_anything_is_donated() -> None:
    name = "linear_adamw"
    t = load(
        golden_bundle(name),
        options=LoadOptions(compile=CompileOptions(steps_per_call=K)),
    )
    batches = _first(name, K)
    before = t.state_dict()
    short = {k: np.stack([b[k] for b in batches[: K - 1]]) for k in batches[0]}
    with pytest.raises(BatchStackError, match=f"leading axis of {K}"):
        t.step_many(short)
    unstacked = dict(batches[0])
    with pytest.raises(BatchStackError, match="Shape mismatch"):
        t.step_many(unstacked)
    wrong_dtype = {k: np.stack([b[k] for b in batches[:K]]).astype(np.float64) for k in batches[0]}
    with pytest.raises(BatchStackError, match="Dtype mismatch"):
        t.step_many(wrong_dtype)
    assert issubclass(BatchStackError, BindingError)
    assert t.step_count == 0
    for k, v in t.state_dict().items():  # readable: nothing was donated
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    good = {k: np.stack([b[k] for b in batches[:K]]) for k in batches[0]}
    t.step_many(good)
    assert t.step_count == K


def test_step_many_needs_steps_per_call_and_bad_values_are_refused() -> None:
    t = load(golden_bundle("linear_adamw"))
    assert t.steps_per_call == 1
    b = golden_batches("linear_adamw")[0]
    with pytest.raises(BatchStackError, match="steps_per_call=1"):
        t.step_many({k: np.stack([v] * K) for k, v in b.items()})
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(UsageError, match="steps_per_call must be a whole number"):
            load(
                golden_bundle("linear_adamw"),
                options=LoadOptions(compile=CompileOptions(steps_per_call=bad)),
            )


def test_a_nonfinite_step_inside_a_call_stops_at_that_step() -> None:
    """With stop_on_nonfinite the call is replayed one step at a time: the state kept is
    the state from before the poisoned step, not from before the call."""
    name = "batchnorm_lr"
    batches = [dict(b) for b in _first(name, K)]
    poisoned = {k: v.copy() for k, v in batches[2].items()}
    poisoned["x"].reshape(-1)[3] = np.nan
    batches[2] = poisoned
    kw = {"stop_on_nonfinite": True, "check_state": True}
    one, many = _pair(name, **kw)
    seen: list[int] = []
    with pytest.raises(NonFiniteLossError) as a:
        one.run(batches, K)
    with pytest.raises(NonFiniteLossError) as b:
        many.run(batches, K, on_step=lambda i, m: seen.append(i))
    assert a.value.step == b.value.step == 2
    assert seen == [0, 1]  # the steps before it were reported
    _assert_identical(one, many, [], [])
    assert many.step_count == 2


def test_request_stop_ends_the_run_after_the_call() -> None:
    t = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(compile=CompileOptions(steps_per_call=K)),
    )
    seen: list[int] = []

    def on_step(i: int, m: Any) -> None:
        seen.append(i)
        assert t.step_count == K  # the state is the state at the end of the call
        if i == 1:
            t.request_stop()

    out = t.run(golden_batches("linear_adamw"), 3 * K, on_step=on_step)
    assert seen == list(range(K))
    assert t.step_count == K
    assert len(out) == K


def test_data_parallel_k_steps_match_data_parallel_single_steps() -> None:
    one, many = _pair("linear_adamw", devices=4)
    batches = golden_batches("linear_adamw")
    m_one = one.run(batches, 2 * K)
    m_many = many.run(batches, 2 * K)
    assert all(isinstance(m["loss"], StepMetric) for m in m_many)
    _assert_identical(one, many, m_one, m_many)


def test_a_resumed_run_aligns_its_calls_to_multiples_of_k(tmp_path: Path) -> None:
    """Resumed at step 3 with K=4, the run takes one single step, then K-step calls: the
    checkpoint it resumed from and the one it writes mean the same as without K."""
    name = "linear_adamw"
    one, many = _pair(name)
    batches = golden_batches(name)
    one.run(batches, 3)
    ckpt = tmp_path / "at3.safetensors"
    one.save_checkpoint(ckpt)
    many.load_checkpoint(ckpt)
    counts: list[int] = []
    m_many = many.run(batches, 9, offset=3, on_step=lambda i, m: counts.append(many.step_count))
    m_one = one.run(batches, 9, offset=3)
    assert counts == [4, 8, 8, 8, 8, 12, 12, 12, 12]
    _assert_identical(one, many, m_one, m_many)


def test_cli_steps_per_call_prints_the_same_lines_and_checkpoints(tmp_path: Path) -> None:
    name = "batchnorm_lr"
    common = [
        "run",
        str(golden_bundle(name)),
        "--steps",
        "10",
        "--data",
        str(GOLDEN_DIR / f"{name}.inputs.npz"),
        "--lr-schedule",
        GOLDEN_SCHEDULES[name],
        "--json",
        "--checkpoint-every",
        "4",
    ]
    # Both through stepbundle.cli.main in this process (cli_here): the lines and files are
    # the point, not the process, and a child would add its jax import to each.
    single = cli_here(*common, "--checkpoint-dir", str(tmp_path / "one"))
    multi = cli_here(*common, "--checkpoint-dir", str(tmp_path / "k"), "--steps-per-call", "4")
    assert single.returncode == 0, single.stderr
    assert multi.returncode == 0, multi.stderr
    assert "4 steps per call" in multi.stderr
    assert multi.stdout == single.stdout  # every step's metrics, bit for bit
    assert len(multi.stdout.splitlines()) == 10
    files = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "one").iterdir())
    assert "step-00000004.safetensors" in files and "step-00000008.safetensors" in files
    for f in files:
        a, meta_a = read_safetensors(tmp_path / "one" / f)
        b, meta_b = read_safetensors(tmp_path / "k" / f)
        assert meta_b == meta_a  # step, seed, hyperparameters, schedules, data position
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(b[key], a[key], err_msg=f"{f}: {key}")


def test_cli_refuses_intervals_that_are_not_multiples_of_k(tmp_path: Path) -> None:
    name = "linear_adamw"
    out = cli_here(  # refused while reading the arguments: in this process
        "run",
        str(golden_bundle(name)),
        "--steps",
        "10",
        "--data",
        str(GOLDEN_DIR / f"{name}.inputs.npz"),
        "--steps-per-call",
        "4",
        "--checkpoint-every",
        "6",
        "--checkpoint-dir",
        str(tmp_path),
    )
    assert out.returncode == 2
    assert "--checkpoint-every 6 is not a multiple of --steps-per-call 4" in out.stderr
    assert "--checkpoint-every 4 or 8" in out.stderr


def _with_step_draws(tmp_path: Any, draws: int) -> Any:
    """dropout_sgd's bundle with ``Rng.step_after_draws`` set (as a checkpointed step's)."""
    import dataclasses

    from stepbundle.schema import SectionPayload, open_bundle, write_bundle

    path = tmp_path / "draws.stepbundle"
    with open_bundle(golden_bundle("dropout_sgd")) as b:
        m = b.manifest
        assert m.rng is not None
        payloads = [SectionPayload(s.name, s.kind, bytes(b.section(s.name))) for s in m.sections]
        m = dataclasses.replace(
            m,
            rng=dataclasses.replace(m.rng, step_after_draws=draws),
            required_features=(*m.required_features, "rng_restored_draws"),
            sections=(),
        )
        write_bundle(path, m, payloads)
    return path


@pytest.mark.parametrize("k", [1, 3])
def test_seed_advances_after_the_bundles_draws_per_step(tmp_path: Any, k: int) -> None:
    path = _with_step_draws(tmp_path, 2)
    t = load(path, options=LoadOptions(compile=CompileOptions(steps_per_call=k)))
    assert t.seed == 12345
    t.run(golden_batches("dropout_sgd"), 3)
    # The oracle: two in-step draws, then the step rule, each step, one at a time.
    x = 12345
    for _ in range(3):
        x = (2531011 + 214013 * x) % 2**64
        x = (2531011 + 214013 * x) % 2**64
        x = (1012031 + x * 7012063) % 2**64
    assert t.seed == x
    plain = 12345
    for _ in range(3):
        plain = (1012031 + plain * 7012063) % 2**64
    assert x != plain
