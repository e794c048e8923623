"""Numerical faults: a step with a non-finite loss can be stopped before it lands.

With ``stop_on_nonfinite`` the trainer compiles without donation and checks each step's
loss: a non-finite loss raises ``NonFiniteLossError``, and the state, step count and seed
stay those from before the step (bit for bit), so they can be checkpointed and training
resumed. ``stepbundle run --stop-on-nonfinite`` exits non-zero with a clear message.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_helpers import cli_here, golden_batches, golden_bundle

from stepbundle.runtime import (
    BindingError,
    DeviceError,
    LoadOptions,
    NonFiniteLossError,
    SafetyOptions,
    load,
)
from stepbundle.schema import (
    BundleError,
    DType,
    MetricOutput,
    SectionPayload,
    TensorSpec,
    open_bundle,
    write_bundle,
)


def _poisoned(batch: dict[str, np.ndarray], value: float) -> dict[str, np.ndarray]:
    bad = {k: v.copy() for k, v in batch.items()}
    bad["x"][0, 0] = value
    return bad


def _assert_same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].tobytes() == b[name].tobytes(), name  # bit for bit


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_nonfinite_loss_stops_the_step_and_keeps_the_state(tmp_path: Path, value: float) -> None:
    batches = golden_batches("linear_adamw")
    trainer = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(safety=SafetyOptions(stop_on_nonfinite=True)),
    )
    trainer.step(batches[0])
    trainer.step(batches[1])
    before = trainer.state_dict()

    with pytest.raises(NonFiniteLossError) as info:
        trainer.step(_poisoned(batches[2], value))
    assert isinstance(info.value, DeviceError) and not isinstance(info.value, BundleError)
    assert info.value.step == 2
    assert not math.isfinite(info.value.metrics["loss"])
    assert "non-finite metrics (loss = " in str(info.value) and "save_checkpoint" in str(info.value)
    assert trainer.step_count == 2
    _assert_same_state(trainer.state_dict(), before)

    # The kept state checkpoints, and a fresh trainer (donating, as usual) resumes from it
    # exactly where a run that never saw the bad batch would be.
    ckpt = tmp_path / "before-nonfinite.safetensors"
    trainer.save_checkpoint(ckpt)
    fresh = load(golden_bundle("linear_adamw"))
    fresh.load_checkpoint(ckpt)
    assert fresh.step_count == 2
    _assert_same_state(fresh.state_dict(), before)
    reference = load(golden_bundle("linear_adamw"))
    reference.step(batches[0])
    reference.step(batches[1])
    want = float(reference.step(batches[2])["loss"])
    assert float(fresh.step(batches[2])["loss"]) == want
    # And the stopped trainer itself carries on with good batches.
    assert float(trainer.step(batches[2])["loss"]) == want
    assert trainer.step_count == 3


def test_without_stop_on_nonfinite_the_bad_step_lands() -> None:
    # The default: no check, no sync; the non-finite values become the state.
    batches = golden_batches("linear_adamw")
    trainer = load(golden_bundle("linear_adamw"))
    trainer.step(batches[0])
    assert not math.isfinite(float(trainer.step(_poisoned(batches[1], math.inf))["loss"]))
    assert trainer.step_count == 2
    assert not np.isfinite(trainer.state_dict()["weight"]).all()


def test_the_seed_is_not_advanced_by_a_stopped_step() -> None:
    # dropout_sgd reads an RNG seed: a stopped step must not consume one.
    batches = golden_batches("dropout_sgd")
    trainer = load(
        golden_bundle("dropout_sgd"),
        options=LoadOptions(safety=SafetyOptions(stop_on_nonfinite=True)),
    )
    trainer.step(batches[0])
    seed = trainer.seed
    with pytest.raises(NonFiniteLossError):
        trainer.step(_poisoned(batches[1], math.nan))
    assert trainer.seed == seed and trainer.step_count == 1


def test_cli_stop_on_nonfinite_exits_nonzero_and_checkpoints(tmp_path: Path) -> None:
    batches = golden_batches("linear_adamw")
    stacked = {k: np.stack([b[k] for b in batches[:3]]) for k in batches[0]}
    stacked["x"][2, 0, 0] = np.inf  # step 2 is poisoned
    data = tmp_path / "poisoned.npz"
    np.savez(data, **stacked)
    ckpt = tmp_path / "ckpt"
    # stepbundle.cli.main in this process (cli_here): its exit code, lines and files are
    # the point, not a child's; a child would add a jax import.
    out = cli_here("run", str(golden_bundle("linear_adamw")), "--steps", "5", "--data",
                   str(data), "--json", "--stop-on-nonfinite", "--checkpoint-dir", str(ckpt))  # fmt: skip
    assert out.returncode != 0
    assert "Step 2 produced non-finite metrics (loss = " in out.stderr
    assert [json.loads(line)["step"] for line in out.stdout.splitlines()] == [0, 1]
    saved = sorted(ckpt.glob("*.safetensors"))
    assert [p.name for p in saved] == ["step-00000002-before-nonfinite.safetensors"]
    reference = load(golden_bundle("linear_adamw"))
    reference.run(batches, 2)
    fresh = load(golden_bundle("linear_adamw"))
    fresh.load_checkpoint(saved[0])
    assert fresh.step_count == 2
    _assert_same_state(fresh.state_dict(), reference.state_dict())


def _with_train_metric(tmp_path: Path, name: str, spec: TensorSpec | None = None) -> Path:
    """linear_adamw with its train programs' 'loss' metric renamed (or re-specced)."""
    with open_bundle(golden_bundle("linear_adamw")) as b:
        manifest = b.manifest
        payloads = [
            SectionPayload(s.name, s.kind, bytes(b.section(s.name))) for s in manifest.sections
        ]

    def edit(o: Any) -> Any:
        if isinstance(o, MetricOutput) and o.name == "loss":
            return dataclasses.replace(o, name=name, spec=spec or o.spec)
        return o

    train = manifest.entries["train"]
    programs = tuple(
        dataclasses.replace(p, outputs=tuple(edit(o) for o in p.outputs)) for p in train.programs
    )
    entries = {**manifest.entries, "train": dataclasses.replace(train, programs=programs)}
    path = tmp_path / f"{name}.stepbundle"
    write_bundle(path, dataclasses.replace(manifest, entries=entries), payloads)
    return path


def test_stop_on_nonfinite_refuses_a_bundle_without_a_loss_metric(tmp_path: Path) -> None:
    # Found by the fuzzer: with the metric renamed there was nothing to watch, and
    # stop_on_nonfinite silently checked nothing.
    path = _with_train_metric(tmp_path, "objective")
    with pytest.raises(BindingError, match="no metric of that name .*'objective'"):
        load(path, options=LoadOptions(safety=SafetyOptions(stop_on_nonfinite=True)))
    trainer = load(path)  # without the flag the bundle is fine
    assert set(trainer.step(golden_batches("linear_adamw")[0])) == {"objective"}


def test_stop_on_nonfinite_refuses_a_loss_that_is_not_one_number(tmp_path: Path) -> None:
    # A loss of more than one element would fail inside step() (float() of an array);
    # it is refused at load, before anything is compiled.
    path = _with_train_metric(tmp_path, "loss", TensorSpec(DType.F32, (2,)))
    with pytest.raises(BindingError, match=r"it is f32\[2\], not a single number"):
        load(path, options=LoadOptions(safety=SafetyOptions(stop_on_nonfinite=True)))
