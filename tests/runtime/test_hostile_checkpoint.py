"""Damaged checkpoints: refused with a CheckpointError, the trainer left as it was.

A checkpoint is input too: a safetensors file whose JSON header names dtypes, shapes and
byte ranges, and whose metadata carries the step count, seed and hyperparameters. Every
size is checked against the file with Python integers (a hostile shape cannot overflow
into a small count), every malformed field is a ``CheckpointError``, and everything is
checked before the trainer changes, so a refused checkpoint leaves the state, step count
and seed as they were. Flipped bytes inside tensor data are not detectable (safetensors
has no checksums) and load as other values.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import CheckpointError, Trainer, load
from stepbundle.runtime.state.checkpoint import read_safetensors


@pytest.fixture(scope="module")
def trainer() -> Trainer:
    t = load(golden_bundle("dropout_sgd"))
    t.run(golden_batches("dropout_sgd"), 2)
    return t


@pytest.fixture(scope="module")
def saved(trainer: Trainer, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("ckpt") / "good.safetensors"
    trainer.save_checkpoint(path)
    return path.read_bytes()


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack_from("<Q", data, 0)
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: Any, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _snapshot(t: Trainer) -> tuple[dict[str, bytes], int, int | None, dict[str, float]]:
    return (
        {k: v.tobytes() for k, v in t.state_dict().items()},
        t.step_count,
        t.seed,
        t.hyperparameters,
    )


def _first_tensor(header: dict[str, Any]) -> str:
    return next(k for k in header if k != "__metadata__")


def _edit_meta(header: dict[str, Any], **changes: Any) -> None:
    meta = json.loads(header["__metadata__"]["stepbundle"])
    meta.update(changes)
    header["__metadata__"]["stepbundle"] = json.dumps(meta)


def _add_empty(header: dict[str, Any], shape: list[int]) -> None:
    end = max(r["data_offsets"][1] for k, r in header.items() if k != "__metadata__")
    header["zz.empty"] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end]}


def _drop_meta(header: dict[str, Any], key: str) -> None:
    meta = json.loads(header["__metadata__"]["stepbundle"])
    del meta[key]
    header["__metadata__"]["stepbundle"] = json.dumps(meta)


HOSTILE_HEADERS: dict[str, Any] = {
    # Shapes whose element count overflows int64 into 0 used to pass the size check and
    # fail later in reshape (ValueError); huge ones overflowed numpy (OverflowError).
    "shape overflowing int64": lambda h, t: h[t].update(shape=[2**32, 2**32]),
    "shape beyond int64": lambda h, t: h[t].update(shape=[2**70]),
    "negative dimension": lambda h, t: h[t].update(shape=[-1, 0]),
    "two negative dimensions": lambda h, t: h[t].update(shape=[-2, -2]),
    "float dimension": lambda h, t: h[t].update(shape=[1.5]),
    "shape not a list": lambda h, t: h[t].update(shape="12"),
    "offsets reversed": lambda h, t: h[t].update(data_offsets=h[t]["data_offsets"][::-1]),
    "offsets negative": lambda h, t: h[t].update(data_offsets=[-4, 0]),
    "three offsets": lambda h, t: h[t].update(data_offsets=[0, 4, 8]),
    "offsets past the end": lambda h, t: h[t].update(data_offsets=[2**40, 2**40 + 4]),
    "unknown dtype": lambda h, t: h[t].update(dtype="F128"),
    "dtype not a string": lambda h, t: h[t].update(dtype=["F32"]),
    "record not an object": lambda h, t: h.update({t: None}),
    "metadata a list": lambda h, t: h.update(__metadata__=[1, 2]),
    "metadata value not a string": lambda h, t: h["__metadata__"].update(stepbundle={"a": 1}),
    "metadata not json": lambda h, t: h["__metadata__"].update(stepbundle="{"),
    "metadata nested too deep": lambda h, t: h["__metadata__"].update(
        stepbundle="[" * 100_000 + "]" * 100_000
    ),
    "metadata not an object": lambda h, t: h["__metadata__"].update(stepbundle="[]"),
    "step null": lambda h, t: _edit_meta(h, step=None),
    "step negative": lambda h, t: _edit_meta(h, step=-1),
    "step a float": lambda h, t: _edit_meta(h, step=2.5),
    # A seed that is not an integer used to fail after the state had been replaced.
    "seed a string": lambda h, t: _edit_meta(h, seed="abc"),
    "seed a list": lambda h, t: _edit_meta(h, seed=[1]),
    "seed too large": lambda h, t: _edit_meta(h, seed=2**64),
    "seed negative": lambda h, t: _edit_meta(h, seed=-1),
    "hyperparameters a list": lambda h, t: _edit_meta(h, hyperparameters=[1]),
    "hyperparameter not finite": lambda h, t: _edit_meta(h, hyperparameters={"lr": "NaN"}),
    "hyperparameter an enormous integer": lambda h, t: _edit_meta(
        h, hyperparameters={"lr": 10**400}
    ),
    # Zero-byte records at the end of the data pass the layout check, so these reach
    # the shape checks themselves (numpy's reshape would raise a ValueError).
    "shape with a zero and a huge dimension": lambda h, t: _add_empty(h, [0, 2**70]),
    "rank 100": lambda h, t: _add_empty(h, [1] * 99 + [0]),
    "a tensor missing": lambda h, t: h.pop(t),
    # The byte ranges must tile the data exactly, as the safetensors library requires.
    "offsets shifted into the next tensor": lambda h, t: h[t].update(
        data_offsets=[x + 4 for x in h[t]["data_offsets"]]
    ),
    "metadata null": lambda h, t: h.update(__metadata__=None),
    "format missing": lambda h, t: _drop_meta(h, "format"),
    "format unknown": lambda h, t: _edit_meta(h, format=99),
    "format a string": lambda h, t: _edit_meta(h, format="1"),
    "format a boolean": lambda h, t: _edit_meta(h, format=True),
    "bundle digest missing": lambda h, t: _drop_meta(h, "bundle_digest"),
    "bundle digest not a string": lambda h, t: _edit_meta(h, bundle_digest=1),
    "bundle digest of another bundle": lambda h, t: _edit_meta(h, bundle_digest="sha256:0"),
}


@pytest.mark.parametrize("edit", sorted(HOSTILE_HEADERS))
def test_a_hostile_checkpoint_header_is_refused_and_nothing_changes(
    trainer: Trainer, saved: bytes, tmp_path: Path, edit: str
) -> None:
    header, body = _split(saved)
    HOSTILE_HEADERS[edit](header, _first_tensor(header))
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(_join(header, body))
    before = _snapshot(trainer)
    with pytest.raises(CheckpointError):
        trainer.load_checkpoint(path)
    assert _snapshot(trainer) == before


def test_a_deeply_nested_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deep.safetensors"
    raw = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="RecursionError"):
        read_safetensors(path)


@pytest.mark.parametrize(
    "damage",
    ["a byte appended", "the last byte cut", "a gap between tensors", "UTF-16 header"],
)
def test_the_reader_refuses_the_layouts_the_safetensors_library_refuses(
    saved: bytes, tmp_path: Path, damage: str
) -> None:
    header, body = _split(saved)
    if damage == "a byte appended":
        data = saved + b"\0"
    elif damage == "the last byte cut":
        data = saved[:-1]
    elif damage == "a gap between tensors":
        # Every tensor but the first moves 8 bytes on; the file grows by those 8 bytes.
        first = _first_tensor(header)
        for name, rec in header.items():
            if name not in ("__metadata__", first):
                rec["data_offsets"] = [x + 8 for x in rec["data_offsets"]]
        end = header[first]["data_offsets"][1]
        data = _join(header, body[:end] + b"\0" * 8 + body[end:])
    else:
        raw = json.dumps(header).encode("utf-16-le")
        data = struct.pack("<Q", len(raw)) + raw + body
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointError):
        read_safetensors(path)
    import safetensors.numpy as safetensors_numpy

    with pytest.raises(Exception):  # noqa: B017 - the library raises its own error types
        safetensors_numpy.load_file(str(path))


@settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_damaged_checkpoints_load_or_raise_checkpoint_errors(
    trainer: Trainer, saved: bytes, tmp_path_factory: pytest.TempPathFactory, data: Any
) -> None:
    header, body = _split(saved)
    mode = data.draw(st.sampled_from(["flip", "truncate", "append", "header", "metadata"]))
    damaged = bytearray(saved)
    if mode == "flip":
        for _ in range(data.draw(st.integers(1, 6))):
            damaged[data.draw(st.integers(0, len(saved) - 1))] ^= data.draw(st.integers(1, 255))
    elif mode == "truncate":
        del damaged[data.draw(st.integers(0, len(saved) - 1)) :]
    elif mode == "append":
        damaged += data.draw(st.binary(min_size=1, max_size=64))
    else:
        edited = copy.deepcopy(header)
        if mode == "header":
            name = data.draw(st.sampled_from(sorted(k for k in edited if k != "__metadata__")))
            key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            edited[name][key] = data.draw(
                st.one_of(
                    st.none(),
                    st.integers(-(2**70), 2**70),
                    st.text(max_size=8),
                    st.lists(st.integers(-(2**66), 2**66), max_size=4),
                )
            )
        else:
            meta = json.loads(edited["__metadata__"]["stepbundle"])
            key = data.draw(st.sampled_from(sorted(meta)))
            meta[key] = data.draw(
                st.one_of(
                    st.none(),
                    st.booleans(),
                    st.integers(-(2**70), 2**70),
                    st.floats(),
                    st.text(max_size=8),
                    st.dictionaries(st.text(max_size=4), st.floats(), max_size=2),
                )
            )
            edited["__metadata__"]["stepbundle"] = json.dumps(meta)
        damaged = bytearray(_join(edited, body))
    note(f"mode {mode}")
    path = tmp_path_factory.mktemp("fuzz") / "damaged.safetensors"
    path.write_bytes(bytes(damaged))
    before = _snapshot(trainer)
    try:
        trainer.load_checkpoint(path)
    except CheckpointError:
        assert _snapshot(trainer) == before
        return
    # It loaded: a damaged checkpoint that still parses (tensor bytes, a seed, a step).
    state = trainer.state_dict()
    for s in trainer.manifest.state:
        assert state[s.name].shape == s.spec.shape
    trainer.load_checkpoint(_restore(tmp_path_factory, saved))


def _restore(tmp_path_factory: pytest.TempPathFactory, saved: bytes) -> Path:
    path = tmp_path_factory.mktemp("good") / "good.safetensors"
    path.write_bytes(saved)
    return path


def test_an_intact_checkpoint_still_round_trips(
    trainer: Trainer, saved: bytes, tmp_path: Path
) -> None:
    path = tmp_path / "good.safetensors"
    path.write_bytes(saved)
    fresh = load(golden_bundle("dropout_sgd"))
    fresh.load_checkpoint(path)
    assert fresh.step_count == 2 and fresh.seed == trainer.seed
    for k, v in trainer.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v)
