"""Starting a run from a checkpoint file: ``StateOptions(init_from=...)``.

A bundle without weights is made here from a golden bundle with the schema's own writer
(parameters and buffers ``external``, the fresh optimizer's zeros ``fill``), and its
missing state is written as safetensors: one file, or shards with a Hugging Face index.
Runs from it must equal the golden bundle's own runs bit for bit. (The exporter's
``include_state=False`` is tested in tests/exporter/test_export_no_state.py.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_helpers import GOLDEN_SCHEDULES, GOLDEN_STEPS, golden_batches, golden_bundle

from stepbundle.runtime import (
    BindingError,
    CheckpointError,
    CompileOptions,
    InitStateError,
    LoadOptions,
    StateOptions,
    _compat,
    load,
)
from stepbundle.runtime.dtypes import NUMPY_DTYPES
from stepbundle.runtime.state.checkpoint import write_safetensors
from stepbundle.runtime.state.init_source import open_source
from stepbundle.schema import (
    STATE_INITIALIZERS,
    SectionKind,
    SectionPayload,
    StateKind,
    open_bundle,
    write_bundle,
)

NAME = "batchnorm_lr"  # parameters, BatchNorm buffers (an i64 among them), Adam, a schedule
STEPS = GOLDEN_STEPS[NAME]


def _weights_free(src: Path, out: Path) -> dict[str, np.ndarray]:
    """``src`` without its parameters and buffers; returns them (the bundle's values)."""
    with open_bundle(src) as b:
        m = b.manifest
        by_section = {s.section: s for s in m.state}
        taken: dict[str, np.ndarray] = {}
        payloads = []
        for sec in m.sections:
            data = bytes(b.section(sec.name))
            entry = by_section.get(sec.name)
            kind = sec.kind
            if entry is not None and entry.kind in (StateKind.PARAMETER, StateKind.BUFFER):
                dt = NUMPY_DTYPES[entry.spec.dtype]
                taken[entry.name] = np.frombuffer(data, dt).reshape(entry.spec.shape).copy()
                kind, data = SectionKind.EXTERNAL, b""
            elif entry is not None:  # a fresh optimizer: all zeros
                assert not any(data), entry.name
                kind, data = SectionKind.FILL, bytes(entry.spec.dtype.itemsize)
            payloads.append(SectionPayload(sec.name, kind, data))
        manifest = type(m)(
            producer=m.producer,
            entries=m.entries,
            state=m.state,
            hyperparameters=m.hyperparameters,
            rng=m.rng,
            sections=(),
            required_features=(STATE_INITIALIZERS,),
        )
    write_bundle(out, manifest, payloads)
    return taken


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("init_from")
    free = d / "free.stepbundle"
    weights = _weights_free(golden_bundle(NAME), free)
    single = d / "model.safetensors"
    write_safetensors(single, weights)
    # Hugging Face's sharded layout: three shards beside model.safetensors.index.json.
    sharded = d / "sharded"
    sharded.mkdir()
    names = sorted(weights)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {n: weights[n] for n in names[i::3]}
        write_safetensors(sharded / shard, part)
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    full = load(golden_bundle(NAME))
    full.set_schedule("lr", GOLDEN_SCHEDULES[NAME])
    metrics = full.run(golden_batches(NAME), STEPS)
    return {
        "dir": d,
        "free": free,
        "weights": weights,
        "single": single,
        "sharded": sharded,
        "losses": [np.asarray(m["loss"]).tobytes() for m in metrics],
        "state": full.state_dict(),
    }


def _run(bundle: Path, **kwargs: Any) -> tuple[list[bytes], dict[str, np.ndarray], Any]:
    t = load(bundle, options=LoadOptions.from_keywords(**kwargs))
    t.set_schedule("lr", GOLDEN_SCHEDULES[NAME])
    metrics = t.run(golden_batches(NAME), STEPS)
    return [np.asarray(m["loss"]).tobytes() for m in metrics], t.state_dict(), t


def _assert_same_run(made: dict[str, Any], got: tuple[list[bytes], dict[str, np.ndarray], Any]):
    losses, state, _ = got
    assert losses == made["losses"]  # bit for bit
    assert sorted(state) == sorted(made["state"])
    for k, v in made["state"].items():
        assert state[k].tobytes() == v.tobytes(), k


@pytest.mark.parametrize("source", ["single", "sharded", "index"])
def test_a_bundle_without_weights_runs_as_the_full_bundle(made: dict[str, Any], source: str):
    path = {
        "single": made["single"],
        "sharded": made["sharded"],  # the folder save_pretrained writes
        "index": made["sharded"] / "model.safetensors.index.json",
    }[source]
    got = _run(made["free"], init_from=path)
    _assert_same_run(made, got)
    origins = got[2].load_info.state_origins
    assert {n for n, o in origins.items() if o == "file"} == set(made["weights"])
    assert {o for n, o in origins.items() if n.startswith("optimizer.")} == {"rule"}


def test_it_refuses_to_load_without_a_checkpoint(made: dict[str, Any]) -> None:
    with pytest.raises(InitStateError, match="it was exported without state") as e:
        load(made["free"])
    assert "init_from=CHECKPOINT" in str(e.value) and "--init-from" in str(e.value)
    assert set(e.value.names) == set(made["weights"])


def test_a_runtime_checkpoint_gives_the_optimizer_state_too(
    made: dict[str, Any], tmp_path: Path
) -> None:
    t = load(golden_bundle(NAME))
    t.set_schedule("lr", GOLDEN_SCHEDULES[NAME])
    t.run(golden_batches(NAME), 2)
    ckpt = tmp_path / "step2.safetensors"
    t.save_checkpoint(ckpt)
    free = load(made["free"], options=LoadOptions(state=StateOptions(init_from=ckpt)))
    assert set(free.load_info.state_origins.values()) == {"file"}
    want = t.state_dict()
    got = free.state_dict()
    for k, v in want.items():
        assert got[k].tobytes() == v.tobytes(), k
    assert free.step_count == 0  # init_from takes tensors; --resume restores the rest


@pytest.fixture
def transfers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the arrays put on a device (the real transfer still runs)."""
    calls: list[int] = []
    real = _compat.put_sharded

    def counting(x: Any, sharding: Any) -> Any:
        calls.append(int(np.asarray(x).size))
        return real(x, sharding)

    monkeypatch.setattr(_compat, "put_sharded", counting)
    yield calls


def _file(made: dict[str, Any], tmp_path: Path, changes: dict[str, Any]) -> Path:
    """The bundle's weights with ``changes`` (a value, or None to leave a tensor out)."""
    values = {**made["weights"], **changes}
    path = tmp_path / "ckpt.safetensors"
    write_safetensors(path, {k: v for k, v in values.items() if v is not None})
    return path


def test_a_missing_tensor_is_refused_before_any_transfer(
    made: dict[str, Any], tmp_path: Path, transfers: list[int]
) -> None:
    path = _file(made, tmp_path, {"2.running_var": None})
    for strict in (True, False):  # the bundle has no value of its own for it
        with pytest.raises(InitStateError) as e:
            load(
                made["free"],
                options=LoadOptions(state=StateOptions(init_from=path, init_strict=strict)),
            )
        assert "lacks 1 state tensor(s) the bundle needs ('2.running_var')" in str(e.value)
        assert e.value.names == ("2.running_var",)
    assert transfers == []


def test_an_unexpected_tensor_is_refused_unless_not_strict(
    made: dict[str, Any], tmp_path: Path, transfers: list[int]
) -> None:
    path = _file(made, tmp_path, {"head.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(InitStateError) as e:
        load(made["free"], options=LoadOptions(state=StateOptions(init_from=path)))
    assert "holds 1 tensor(s) the bundle's state table does not name: 'head.weight'" in str(e.value)
    assert "strict=False (--no-init-strict)" in str(e.value)
    assert e.value.names == ("head.weight",)
    assert transfers == []
    got = _run(made["free"], init_from=path, init_strict=False)
    _assert_same_run(made, got)
    assert got[2].load_info.ignored_tensors == ("head.weight",)


def test_a_wrong_shape_is_refused_even_when_not_strict(
    made: dict[str, Any], tmp_path: Path, transfers: list[int]
) -> None:
    path = _file(made, tmp_path, {"0.weight": np.zeros((4, 8), np.float32)})
    for strict in (True, False):
        with pytest.raises(InitStateError) as e:
            load(
                made["free"],
                options=LoadOptions(state=StateOptions(init_from=path, init_strict=strict)),
            )
        assert "0.weight: the file has f32[4,8], the bundle f32[8,4]" in str(e.value)
        assert "of another shape" in str(e.value) and "Nothing was loaded" in str(e.value)
        assert e.value.names == ("0.weight",)
    assert transfers == []


def test_a_wrong_dtype_is_refused(
    made: dict[str, Any], tmp_path: Path, transfers: list[int]
) -> None:
    path = _file(made, tmp_path, {"2.num_batches_tracked": np.zeros((), np.int32)})
    with pytest.raises(InitStateError) as e:
        load(
            made["free"], options=LoadOptions(state=StateOptions(init_from=path, init_strict=False))
        )
    assert "2.num_batches_tracked: the file has i32[], the bundle i64[]" in str(e.value)
    assert "of another dtype" in str(e.value) and "Nothing was loaded" in str(e.value)
    assert e.value.names == ("2.num_batches_tracked",)
    assert transfers == []


def test_a_full_bundle_takes_what_the_file_holds(made: dict[str, Any], tmp_path: Path) -> None:
    w = made["weights"]["0.weight"] + 1.0
    path = tmp_path / "partial.safetensors"
    write_safetensors(path, {"0.weight": w})
    with pytest.raises(InitStateError, match="Without strict") as e:  # lacks parameters
        load(golden_bundle(NAME), options=LoadOptions(state=StateOptions(init_from=path)))
    with open_bundle(golden_bundle(NAME)) as b:  # the parameters, which strict wants
        params = {s.name for s in b.manifest.state if s.kind is StateKind.PARAMETER}
    assert "lacks" in str(e.value) and set(e.value.names) == params - {"0.weight"}
    t = load(
        golden_bundle(NAME),
        options=LoadOptions(state=StateOptions(init_from=path, init_strict=False)),
    )
    assert t.state_dict()["0.weight"].tobytes() == w.tobytes()
    assert t.state_dict()["0.bias"].tobytes() == made["weights"]["0.bias"].tobytes()
    origins = t.load_info.state_origins
    assert origins["0.weight"] == "file" and origins["0.bias"] == "stored"


def test_bad_sources_are_refused_with_what_to_give(made: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        open_source(tmp_path / "nope.safetensors")
    with pytest.raises(CheckpointError, match="holds neither model.safetensors.index.json"):
        open_source(tmp_path)
    shards = made["sharded"]
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in shards.glob("*.safetensors"):
        (broken / f.name).write_bytes(f.read_bytes())
    index["weight_map"]["0.weight"] = "model-00009-of-00009.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="Copy every shard of the checkpoint beside"):
        open_source(broken)
    original = json.loads((shards / "model.safetensors.index.json").read_text())["weight_map"]
    other = next(s for s in sorted(set(original.values())) if s != original["0.weight"])
    index["weight_map"]["0.weight"] = other  # a shard that does not hold it
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="which does not hold it"):
        open_source(broken)
    index["weight_map"]["0.weight"] = "../elsewhere.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not name a file beside the index"):
        open_source(broken)


def test_a_checkpoint_at_a_url_starts_the_run(made: dict[str, Any]) -> None:
    """An index and its shards served over HTTP give the same run as the local folder."""
    from remote_helpers import BundleServer, Served

    server = BundleServer().start()
    try:
        for f in sorted(made["sharded"].iterdir()):
            server.objects[f"ckpt/{f.name}"] = Served(f.read_bytes())
        got = _run(made["free"], init_from=f"{server.url}/ckpt/model.safetensors.index.json")
        _assert_same_run(made, got)
        fetched = {name for _, name, _ in server.requests}
        assert fetched == set(server.objects)  # the index and every shard, nothing else
        with pytest.raises(CheckpointError, match="does not exist"):
            load(
                made["free"],
                options=LoadOptions(
                    state=StateOptions(init_from=f"{server.url}/ckpt/absent.safetensors")
                ),
            )
    finally:
        server.stop()


def test_compile_needs_no_weights_and_places_nothing(made: dict[str, Any], tmp_path: Path) -> None:
    """``stepbundle compile`` of a weights-free bundle fills the cache without a checkpoint;
    the run that follows (its checkpoint given as a file:// URL) compiles nothing."""
    from stepbundle.cli.main import main

    cache = tmp_path / "xla"
    assert main(["compile", str(made["free"]), "--cache-dir", str(cache)]) == 0
    t = load(
        made["free"],
        options=LoadOptions(compile=CompileOptions(cache_dir=cache, compile_only=True)),
    )
    assert t.load_info.compiled == 0 and t.load_info.cache_hits > 0
    assert t.load_info.state_origins == {}
    with pytest.raises(BindingError, match="compile_only"):
        t.step(golden_batches(NAME)[0])
    got = _run(made["free"], init_from=made["single"].as_uri(), cache_dir=cache)
    assert got[2].load_info.compiled == 0
    _assert_same_run(made, got)
    data = tmp_path / "d.npz"
    batches = golden_batches(NAME)
    np.savez(data, **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    run = ["run", str(made["free"]), "--steps", "2", "--data", str(data), "--cache-dir"]
    assert main([*run, str(cache), "--init-from", made["single"].as_uri()]) == 0


def test_a_torch_save_file_is_named_as_one_with_the_conversion(tmp_path: Path) -> None:
    """torch.save() writes a zip archive (older torch: a bare pickle); read as safetensors
    its first 8 bytes made an absurd header length, which the message quoted."""
    import zipfile

    from stepbundle.runtime.io.tensor_file import open_safetensors

    archive = tmp_path / "model.pt"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    legacy = tmp_path / "legacy.pt"
    legacy.write_bytes(b"\x80\x02}q\x00." + b"\0" * 16)  # a protocol-2 pickle's bytes
    for path in (archive, legacy):
        with pytest.raises(CheckpointError, match=r"not a safetensors file.*torch\.save"):
            open_safetensors(path)
