"""Checkpoints: exact resume, safetensors compatibility, refusal of foreign state."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import CheckpointError, load
from stepbundle.runtime.checkpoint import read_safetensors, write_safetensors


@pytest.mark.parametrize("name", ["dropout_sgd", "batchnorm_lr"])
def test_resume_is_equivalent_to_never_stopping(name: str, tmp_path: Path) -> None:
    batches = golden_batches(name)
    whole = load(golden_bundle(name), cache_dir=False)
    whole.set_schedule("lr", (lambda s: 0.01 / (1 + s))) if name == "batchnorm_lr" else None
    losses = [float(m["loss"]) for m in whole.run(batches, 6)]

    first = load(golden_bundle(name), cache_dir=False)
    first.set_schedule("lr", (lambda s: 0.01 / (1 + s))) if name == "batchnorm_lr" else None
    part1 = [float(m["loss"]) for m in first.run(batches, 3)]
    ckpt = tmp_path / "ckpt.safetensors"
    first.save_checkpoint(ckpt)

    second = load(golden_bundle(name), cache_dir=False)
    second.set_schedule("lr", (lambda s: 0.01 / (1 + s))) if name == "batchnorm_lr" else None
    second.load_checkpoint(ckpt)
    assert second.step_count == 3
    assert second.seed == first.seed
    part2 = [float(second.step(batches[i % len(batches)])["loss"]) for i in range(3, 6)]
    assert part1 + part2 == losses
    for k, v in whole.state_dict().items():
        np.testing.assert_array_equal(second.state_dict()[k], v, err_msg=k)


def test_checkpoint_is_plain_safetensors(tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    t = load(golden_bundle("linear_adamw"), cache_dir=False)
    t.step(golden_batches("linear_adamw")[0])
    path = tmp_path / "c.safetensors"
    t.save_checkpoint(path)
    theirs = safetensors_numpy.load_file(str(path))
    ours = t.state_dict()
    assert set(theirs) == set(ours)
    for k in ours:
        np.testing.assert_array_equal(theirs[k], ours[k])
    _, meta = read_safetensors(path)
    info = json.loads(meta["stepbundle"])
    assert info["step"] == 1
    assert info["bundle_digest"] == t.digest
    # Our reader reads what the safetensors package writes, too.
    other = tmp_path / "theirs.safetensors"
    safetensors_numpy.save_file({"a": np.arange(6, dtype=np.int64).reshape(2, 3)}, str(other))
    back, _ = read_safetensors(other)
    np.testing.assert_array_equal(back["a"], np.arange(6).reshape(2, 3))


def test_foreign_checkpoint_is_refused_and_state_kept(tmp_path: Path) -> None:
    linear = load(golden_bundle("linear_adamw"), cache_dir=False)
    other = load(golden_bundle("dropout_sgd"), cache_dir=False)
    path = tmp_path / "other.safetensors"
    other.save_checkpoint(path)
    before = linear.state_dict()
    with pytest.raises(CheckpointError, match="does not match this bundle's state table"):
        linear.load_checkpoint(path)
    for k, v in before.items():
        np.testing.assert_array_equal(linear.state_dict()[k], v)
    plain = tmp_path / "plain.safetensors"
    write_safetensors(plain, linear.state_dict())
    with pytest.raises(CheckpointError, match="no stepbundle metadata"):
        linear.load_checkpoint(plain)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(CheckpointError):
        linear.load_checkpoint(tmp_path / "junk.safetensors")


def test_wrong_dtype_in_state_is_refused(tmp_path: Path) -> None:
    t = load(golden_bundle("linear_adamw"), cache_dir=False)
    sd = t.state_dict()
    sd["weight"] = sd["weight"].astype(np.float64)
    with pytest.raises(CheckpointError, match="'weight' is float64"):
        t.load_state_dict(sd)
