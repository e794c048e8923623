"""Checkpoints written to and resumed from URLs behave exactly as local paths.

Two kinds of URL: ``file://`` (a local path by another name) and ``fakestore://``, a
local folder behind a non-local fsspec file system, which takes the upload path every
object store takes (a temporary object, then a move). The oracles: the same run with
local paths (byte-identical files), and a run that never stopped (bit-identical state
and losses). An upload that breaks off must leave the previous checkpoint whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from remote_helpers import FakeObjectStore, fake_store
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.cli.main import main
from stepbundle.runtime import CheckpointError, CompileOptions, LoadOptions, load

NAME = "dropout_sgd"  # a seed that advances every step: resume must restore it exactly
BATCHES = golden_batches(NAME)


@pytest.fixture
def store_root(tmp_path: Path) -> Iterator[Path]:
    yield from fake_store(tmp_path / "objects")


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla")


@pytest.fixture(scope="module")
def whole(xla_cache: Path) -> tuple[list[float], dict[str, np.ndarray]]:
    """Six steps that never stopped: losses and final state."""
    t = load(golden_bundle(NAME), options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache)))
    losses = [float(m["loss"]) for m in t.run(BATCHES, 6)]
    return losses, t.state_dict()


def _resume_through(
    location: str, local: Path, xla_cache: Path, whole: tuple[list[float], dict[str, np.ndarray]]
) -> None:
    first = load(
        golden_bundle(NAME), options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache))
    )
    part1 = [float(m["loss"]) for m in first.run(BATCHES, 3)]
    first.save_checkpoint(location)
    first.save_checkpoint(local)

    second = load(
        golden_bundle(NAME), options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache))
    )
    second.load_checkpoint(location)
    assert (second.step_count, second.seed) == (3, first.seed)
    part2 = [float(second.step(BATCHES[i % len(BATCHES)])["loss"]) for i in range(3, 6)]
    losses, state = whole
    assert part1 + part2 == losses
    got = second.state_dict()
    for k, v in state.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_file_url_checkpoints_are_local_checkpoints(
    tmp_path: Path, xla_cache: Path, whole: tuple[list[float], dict[str, np.ndarray]]
) -> None:
    target = tmp_path / "by-url" / "step-3.safetensors"
    _resume_through(target.as_uri(), tmp_path / "local.safetensors", xla_cache, whole)
    assert target.read_bytes() == (tmp_path / "local.safetensors").read_bytes()


def test_object_store_checkpoints_resume_bit_exactly(
    store_root: Path,
    tmp_path: Path,
    xla_cache: Path,
    whole: tuple[list[float], dict[str, np.ndarray]],
) -> None:
    url = "fakestore://bucket/run-a/step-3.safetensors"
    _resume_through(url, tmp_path / "local.safetensors", xla_cache, whole)
    stored = store_root / "bucket" / "run-a" / "step-3.safetensors"
    assert stored.read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    assert sorted(p.name for p in stored.parent.iterdir()) == [stored.name]  # no temp left


def test_a_broken_upload_leaves_the_previous_checkpoint(store_root: Path, xla_cache: Path) -> None:
    url = "fakestore://bucket/run-b/last.safetensors"
    t = load(golden_bundle(NAME), options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache)))
    t.step(BATCHES[0])
    t.save_checkpoint(url)
    stored = store_root / "bucket" / "run-b" / "last.safetensors"
    before = stored.read_bytes()
    t.step(BATCHES[1])
    FakeObjectStore.fail_writes_after = len(before) // 2
    with pytest.raises(CheckpointError, match="dropped the upload") as e:
        t.save_checkpoint(url)
    assert url in str(e.value) and "untouched" in str(e.value)
    FakeObjectStore.fail_writes_after = None
    assert stored.read_bytes() == before
    assert sorted(p.name for p in stored.parent.iterdir()) == [stored.name]
    fresh = load(
        golden_bundle(NAME), options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache))
    )
    fresh.load_checkpoint(url)
    assert fresh.step_count == 1
    with pytest.raises(CheckpointError, match="Cannot read checkpoint fakestore://.*missing"):
        fresh.load_checkpoint("fakestore://bucket/run-b/missing.safetensors")


def test_cli_runs_into_and_resumes_from_an_object_store(
    store_root: Path,
    tmp_path: Path,
    xla_cache: Path,
    whole: tuple[list[float], dict[str, np.ndarray]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "d.npz"
    np.savez(data, **{k: np.stack([b[k] for b in BATCHES]) for k in BATCHES[0]})
    folder = "fakestore://bucket/cli-run"
    common = [
        *("run", str(golden_bundle(NAME)), "--data", str(data), "--json"),
        *("--checkpoint-dir", folder, "--cache-dir", str(xla_cache)),
    ]
    assert main([*common, "--until-step", "3"]) == 0
    assert main([*common, "--until-step", "6"]) == 2  # earlier checkpoints, no --resume
    first = capsys.readouterr()
    err = first.err
    assert "already holds checkpoints (step-00000003.safetensors" in err
    assert f"--resume {folder}/step-00000003.safetensors" in err
    resume = ["--resume", f"{folder}/step-00000003.safetensors"]
    assert main([*common, "--until-step", "6", *resume, "--save-state", f"{folder}/final"]) == 0
    out = first.out + capsys.readouterr().out
    losses = [json.loads(line)["loss"] for line in out.splitlines()]
    assert losses == whole[0]
    names = sorted(p.name for p in (store_root / "bucket" / "cli-run").iterdir())
    assert names == ["final", "step-00000003.safetensors", "step-00000006.safetensors"]
    final = load(
        golden_bundle(NAME), options=LoadOptions(compile=CompileOptions(cache_dir=xla_cache))
    )
    final.load_checkpoint(f"{folder}/final")
    for k, v in whole[1].items():
        np.testing.assert_array_equal(final.state_dict()[k], v, err_msg=k)
