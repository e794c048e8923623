"""Checkpoints: exact resume, safetensors compatibility, refusal of foreign state."""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import (
    CheckpointError,
    LoadOptions,
    OtherBundleError,
    StateOptions,
    load,
)
from stepbundle.runtime.state.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointMeta,
    checkpoint_digest,
    read_checkpoint,
    read_safetensors,
    write_checkpoint,
    write_order,
    write_safetensors,
)
from stepbundle.runtime.state.named import OrderedReads


@pytest.mark.parametrize("name", ["dropout_sgd", "batchnorm_lr"])
def test_resume_is_equivalent_to_never_stopping(name: str, tmp_path: Path) -> None:
    batches = golden_batches(name)
    whole = load(golden_bundle(name))
    whole.set_schedule("lr", (lambda s: 0.01 / (1 + s))) if name == "batchnorm_lr" else None
    losses = [float(m["loss"]) for m in whole.run(batches, 6)]

    first = load(golden_bundle(name))
    first.set_schedule("lr", (lambda s: 0.01 / (1 + s))) if name == "batchnorm_lr" else None
    part1 = [float(m["loss"]) for m in first.run(batches, 3)]
    ckpt = tmp_path / "ckpt.safetensors"
    first.save_checkpoint(ckpt)

    second = load(golden_bundle(name))
    second.set_schedule("lr", (lambda s: 0.01 / (1 + s))) if name == "batchnorm_lr" else None
    second.load_checkpoint(ckpt)
    assert second.step_count == 3
    assert second.seed == first.seed
    part2 = [float(second.step(batches[i % len(batches)])["loss"]) for i in range(3, 6)]
    assert part1 + part2 == losses
    for k, v in whole.state_dict().items():
        np.testing.assert_array_equal(second.state_dict()[k], v, err_msg=k)


def test_state_dict_without_copy_reads_the_cpu_buffers_in_place() -> None:
    """``state_dict(copy=False)`` (the export check's child writes the state so): the same
    names and values as the copies; a buffer of its own on the CPU comes as a read-only
    view of the device buffer, not a copy, and keeps its values through a later step
    (the view keeps its buffer alive)."""
    options = LoadOptions(state=StateOptions(pack_state=False))
    t = load(golden_bundle("linear_adamw"), options=options)
    batch = golden_batches("linear_adamw")[0]
    t.step(batch)
    views, copies = t.state_dict(copy=False), t.state_dict()
    assert sorted(views) == sorted(copies)
    for name, value in copies.items():
        np.testing.assert_array_equal(views[name], value, err_msg=name)
        assert value.flags.writeable, name
        assert not views[name].flags.writeable, name
    t.step(batch)
    t.block_until_ready()
    assert not np.array_equal(t.state_dict()["weight"], copies["weight"])
    for name, value in copies.items():
        np.testing.assert_array_equal(views[name], value, err_msg=name)


def test_checkpoint_is_plain_safetensors(tmp_path: Path) -> None:
    import safetensors.numpy as safetensors_numpy

    t = load(golden_bundle("linear_adamw"))
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
    linear = load(golden_bundle("linear_adamw"))
    other = load(golden_bundle("dropout_sgd"))
    path = tmp_path / "other.safetensors"
    other.save_checkpoint(path)
    before = linear.state_dict()
    with pytest.raises(OtherBundleError) as refused:
        linear.load_checkpoint(path)
    assert other.digest in str(refused.value) and linear.digest in str(refused.value)
    assert "allow_other_bundle=True" in str(refused.value)
    with pytest.raises(CheckpointError, match="does not match this bundle's state table"):
        linear.load_checkpoint(path, allow_other_bundle=True)
    for k, v in before.items():
        np.testing.assert_array_equal(linear.state_dict()[k], v)
    assert linear.step_count == 0
    plain = tmp_path / "plain.safetensors"
    write_safetensors(plain, linear.state_dict())
    with pytest.raises(CheckpointError, match="no stepbundle metadata"):
        linear.load_checkpoint(plain)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(CheckpointError):
        linear.load_checkpoint(tmp_path / "junk.safetensors")


def test_wrong_dtype_in_state_is_refused(tmp_path: Path) -> None:
    t = load(golden_bundle("linear_adamw"))
    sd = t.state_dict()
    sd["weight"] = sd["weight"].astype(np.float64)
    with pytest.raises(CheckpointError, match="'weight' is float64"):
        t.load_state_dict(sd)


def _with_metadata(src: Path, dst: Path, *, sign: bool = True, **changes: Any) -> Path:
    """A copy of the checkpoint ``src`` with its stepbundle metadata changed.

    With ``sign``, the digest is computed again, as a writer of such a file would have;
    without, the file is a damaged one.
    """
    data = src.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["stepbundle"])
    meta.update(changes)
    if sign and "sha256" in meta and meta.get("format") == CHECKPOINT_FORMAT:
        parsed = CheckpointMeta.from_json(src, json.dumps(meta))
        meta["sha256"] = checkpoint_digest(parsed, read_safetensors(src)[0])
    header["__metadata__"]["stepbundle"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    return dst


def _without_digest(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose stepbundle metadata has no ``sha256`` field (format 1)."""
    data = src.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["stepbundle"])
    meta.pop("sha256", None)
    header["__metadata__"]["stepbundle"] = json.dumps(meta)
    raw = json.dumps(header).encode()
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    return dst


def test_a_checkpoint_of_another_bundle_loads_only_when_allowed(tmp_path: Path) -> None:
    # The same model and optimizer exported again: another digest, the same state table.
    batches = golden_batches("linear_adamw")
    first = load(golden_bundle("linear_adamw"))
    first.run(batches, 2)
    path = tmp_path / "c.safetensors"
    first.save_checkpoint(path)
    other = "sha256:" + "0" * 64
    moved = _with_metadata(path, tmp_path / "moved.safetensors", bundle_digest=other)
    second = load(golden_bundle("linear_adamw"))
    with pytest.raises(OtherBundleError, match="allow_other_bundle=True") as refused:
        second.load_checkpoint(moved)
    assert other in str(refused.value) and second.digest in str(refused.value)
    assert second.step_count == 0
    second.load_checkpoint(moved, allow_other_bundle=True)
    assert second.step_count == 2
    for k, v in first.state_dict().items():
        np.testing.assert_array_equal(second.state_dict()[k], v, err_msg=k)


@pytest.mark.parametrize("found", [CHECKPOINT_FORMAT + 1, 0, "1", None])
def test_an_unknown_checkpoint_format_is_refused(tmp_path: Path, found: Any) -> None:
    t = load(golden_bundle("linear_adamw"))
    path = tmp_path / "c.safetensors"
    t.save_checkpoint(path)
    changed = _with_metadata(path, tmp_path / "new.safetensors", format=found)
    t.step(golden_batches("linear_adamw")[0])
    with pytest.raises(CheckpointError) as refused:
        t.load_checkpoint(changed, allow_other_bundle=True)
    message = str(refused.value)
    assert f"has format {found!r}" in message
    assert "reads checkpoint formats 1, 2 only" in message
    assert t.step_count == 1


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_checkpoint_files_get_the_umasks_permissions(tmp_path: Path, umask: int) -> None:
    t = load(golden_bundle("linear_adamw"))
    old = os.umask(umask)
    try:
        t.save_checkpoint(tmp_path / "c.safetensors")
        write_safetensors(tmp_path / "plain.safetensors", {"a": np.zeros(3, np.float32)})
    finally:
        os.umask(old)
    for name in ("c.safetensors", "plain.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


def test_a_flipped_tensor_byte_is_refused_and_format_1_still_loads(tmp_path: Path) -> None:
    t = load(golden_bundle("linear_adamw"))
    t.step(golden_batches("linear_adamw")[0])
    path = tmp_path / "c.safetensors"
    t.save_checkpoint(path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's bytes: the header still parses
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(bytes(data))
    fresh = load(golden_bundle("linear_adamw"))
    with pytest.raises(CheckpointError, match="its metadata or tensors do not match the digest"):
        fresh.load_checkpoint(flipped)
    assert fresh.step_count == 0
    # A file of format 1 (written before the digest existed) is read without one.
    src = json.loads(read_safetensors(path)[1]["stepbundle"])
    assert src["format"] == CHECKPOINT_FORMAT == 2 and len(src["sha256"]) == 64
    # A format-2 file relabelled as format 1 (to skip the digest) is refused.
    relabelled = _with_metadata(path, tmp_path / "relabelled.safetensors", format=1)
    with pytest.raises(CheckpointError, match="says format 1 but carries a digest"):
        fresh.load_checkpoint(relabelled)
    old = _without_digest(relabelled, tmp_path / "format1.safetensors")
    fresh.load_checkpoint(old)
    assert fresh.step_count == 1


def test_an_edited_step_or_lr_in_the_metadata_is_refused(tmp_path: Path) -> None:
    t = load(golden_bundle("batchnorm_lr"))
    t.step(golden_batches("batchnorm_lr")[0])
    path = tmp_path / "c.safetensors"
    t.save_checkpoint(path)
    for change in ({"step": 9}, {"hyperparameters": {"lr": 0.9}}):
        edited = _with_metadata(path, tmp_path / "edited.safetensors", sign=False, **change)
        fresh = load(
            golden_bundle("batchnorm_lr"),
            options=LoadOptions(),
        )
        with pytest.raises(CheckpointError, match="do not match the digest"):
            fresh.load_checkpoint(edited)
        assert fresh.step_count == 0


def test_the_write_reads_its_tensors_in_the_order_every_process_joins(tmp_path: Path) -> None:
    """A multi-process job's processes join each gather of a streamed checkpoint in
    ``write_order``: ``write_checkpoint`` must read in exactly that order (a read out
    of it is refused), and the file is the one ``save_checkpoint`` writes."""
    trainer = load(golden_bundle("batchnorm_lr"))  # aliases none; packs of small tensors
    trainer.run(golden_batches("batchnorm_lr"), 2)
    trainer.save_checkpoint(tmp_path / "saved.safetensors")
    streamed = trainer._store.streamed()
    reads = OrderedReads(streamed, write_order(streamed))
    _, meta = read_checkpoint(tmp_path / "saved.safetensors")
    write_checkpoint(tmp_path / "ordered.safetensors", reads, meta, streamed.specs)
    assert reads.reads_left == 0
    saved = (tmp_path / "saved.safetensors").read_bytes()
    assert (tmp_path / "ordered.safetensors").read_bytes() == saved


def test_a_read_out_of_the_agreed_order_is_refused_and_finish_makes_the_rest() -> None:
    trainer = load(golden_bundle("dropout_sgd"))
    streamed = trainer._store.streamed()
    order = write_order(streamed)
    assert order == sorted(trainer.state_dict()) * 2
    reads = OrderedReads(streamed, order)
    np.testing.assert_array_equal(reads[order[0]], trainer.state_dict()[order[0]])
    with pytest.raises(CheckpointError, match=f"read {order[2]!r} where .* reads {order[1]!r}"):
        reads[order[2]]
    assert reads.reads_left == len(order) - 1  # the refused read gathered nothing
    reads.finish()
    assert reads.reads_left == 0
    with pytest.raises(CheckpointError, match="reads nothing more"):
        reads[order[0]]
