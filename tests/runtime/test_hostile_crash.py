"""Crash safety: a writer SIGKILLed mid-write never damages the file it replaces.

Bundle writes (``write_bundle``) and checkpoint writes (``Trainer.save_checkpoint``) go to
a temp file in the same folder, are flushed to disk and renamed onto the target. Here a
child process overwrites a previous bundle or checkpoint and is killed at known points
(hostile_writer_child.py): inside the data write (of a 48 MB section, for bundles),
before the fsync, and before the rename. Afterwards the target holds the previous file,
byte for byte, and it opens, verifies and loads; the stray temp file it left behind is
recognisably a temp file, is refused cleanly if someone opens it, and does not stop the
next write.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import CheckpointError, CompileOptions, LoadOptions, SafetyOptions, load
from stepbundle.runtime.state.checkpoint import read_safetensors
from stepbundle.schema import BundleError, SectionPayload, open_bundle, write_bundle

CHILD = Path(__file__).resolve().parent / "hostile_writer_child.py"
POINTS = {"data": "READY after writing", "fsync": "READY before os.fsync",
          "replace": "READY before os.replace"}  # fmt: skip


def kill_mid_write(mode: str, target: Path, cache: Path) -> str:
    """Run the child writer over ``target`` and SIGKILL it where it stopped."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), mode, str(target), str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        # The child prints READY once it is at the point (never wait for ever on it).
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready, "the writer never reached its stopping point"
        line = proc.stdout.readline()
        assert line.startswith("READY"), (line, proc.communicate(timeout=60))
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return line.strip()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla-cache")


def _strays(folder: Path, target: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p != target)


# -- bundles -------------------------------------------------------------------------------


def _write_previous_bundle(target: Path) -> tuple[bytes, str]:
    with open_bundle(golden_bundle("linear_adamw")) as b:
        payloads = [
            SectionPayload(s.name, s.kind, bytes(b.section(s.name))) for s in b.manifest.sections
        ]
        write_bundle(target, b.manifest, payloads)
        digest = b.digest
    return target.read_bytes(), digest


@pytest.mark.parametrize("point", ["data", "fsync", "replace"])
def test_a_bundle_writer_killed_mid_write_leaves_the_previous_bundle(
    tmp_path: Path, cache: Path, point: str
) -> None:
    folder = tmp_path / "bundles"
    folder.mkdir()
    target = folder / "model.stepbundle"
    previous, digest = _write_previous_bundle(target)

    where = kill_mid_write(f"bundle-{point}", target, cache)
    assert where.startswith(POINTS[point]), where

    assert target.read_bytes() == previous, where
    with open_bundle(target) as b:
        assert b.verify() == []
        assert b.digest == digest
    trainer = load(
        target,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=cache), safety=SafetyOptions(expect_digest=digest)
        ),
    )
    assert np.isfinite(float(trainer.step(golden_batches("linear_adamw")[0])["loss"]))

    # The killed writer left its temp file: hidden, named after the target, never the
    # target itself; a reader that opens it anyway gets a clean error or a whole bundle.
    strays = _strays(folder, target)
    assert len(strays) == 1, strays
    stray = strays[0]
    assert stray.name.startswith(f".{target.name}.tmp-")
    if point == "data":
        assert stray.stat().st_size >= 20 * 1024 * 1024  # killed inside the 48 MB section
        with pytest.raises(BundleError, match="truncated"):
            open_bundle(stray)
    else:
        with open_bundle(stray) as b:  # complete but never renamed: a bundle, not the target
            assert b.digest != digest

    # The next write is not disturbed by the stray temp file.
    _write_previous_bundle(target)
    with open_bundle(target) as b:
        assert b.verify() == []


# -- checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["data", "fsync", "replace"])
def test_a_checkpoint_writer_killed_mid_write_leaves_the_previous_checkpoint(
    tmp_path: Path, cache: Path, point: str
) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    target = folder / "step.safetensors"
    batches = golden_batches("linear_adamw")
    trainer = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    trainer.step(batches[0])
    trainer.save_checkpoint(target)
    previous = target.read_bytes()
    saved_state = trainer.state_dict()

    where = kill_mid_write(f"checkpoint-{point}", target, cache)
    assert where.startswith(POINTS[point]), where

    assert target.read_bytes() == previous, where
    fresh = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    fresh.load_checkpoint(target)
    assert fresh.step_count == 1
    restored = fresh.state_dict()
    for name, value in saved_state.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
    assert np.isfinite(float(fresh.step(batches[1])["loss"]))

    strays = _strays(folder, target)
    assert len(strays) == 1, strays
    stray = strays[0]
    # Hidden and not named *.safetensors: a glob for checkpoints does not pick it up.
    assert stray.name.startswith(f".{target.name}.tmp-")
    assert sorted(folder.glob("*.safetensors")) == [target]
    if point == "data":
        with pytest.raises(CheckpointError):
            read_safetensors(stray)

    fresh.save_checkpoint(target)  # the next save is not disturbed
    again = load(
        golden_bundle("linear_adamw"), options=LoadOptions(compile=CompileOptions(cache_dir=cache))
    )
    again.load_checkpoint(target)
    assert again.step_count == 2
