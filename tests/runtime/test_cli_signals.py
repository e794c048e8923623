"""Preemption: SIGTERM or Ctrl-C stops `stepbundle run` at a step boundary, writes a final
checkpoint and --save-state, and a resume from that checkpoint ends bit-identical to the
run that was never interrupted. A closed stdout stops the run the same way."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import GOLDEN_DIR, cli_here, golden_bundle

from stepbundle.runtime.state.checkpoint import read_safetensors

NAME = "dropout_sgd"  # RNG seed, dropout: a resume that lost the seed would show
TOTAL = 6000  # the interrupted run's --steps: far more than it takes before the signal
# Steps compared after the stop: the resumed run's and, past the stop, the uninterrupted
# one's. A lost seed, step count or optimizer state shows at the first step after the
# resume; the thousands of steps left to TOTAL would only add seconds.
AFTER = 100


def run_cmd(*extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "stepbundle",
        "run",
        str(golden_bundle(NAME)),
        "--data",
        str(GOLDEN_DIR / f"{NAME}.inputs.npz"),
        *extra,
    ]


def tensors(path: Path) -> dict[str, np.ndarray]:
    return dict(read_safetensors(path)[0])


def interrupted_run(tmp_path: Path, sig: signal.Signals) -> tuple[int, int, str]:
    """Start a run, signal it once its 11th step has reported, return (code, step, stderr)."""
    proc = subprocess.Popen(
        run_cmd(
            "--steps",
            str(TOTAL),
            "--json",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--save-state",
            str(tmp_path / "stopped.safetensors"),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for _ in range(11):
        assert proc.stdout.readline().startswith('{"step": ')
    proc.send_signal(sig)
    # Read the rest through the same buffered reader: communicate() reads the pipe's
    # file descriptor directly and would miss lines readline() already buffered.
    out = proc.stdout.read()
    assert proc.stderr is not None
    err = proc.stderr.read()
    steps_reported = 11 + len(out.splitlines())
    return proc.wait(timeout=300), steps_reported, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_a_step_boundary_and_the_resume_is_bit_identical(
    tmp_path: Path, sig: signal.Signals
) -> None:
    code, reported, err = interrupted_run(tmp_path, sig)
    assert code == 128 + sig, err
    assert "Traceback" not in err
    assert f"({sig.name})" in err
    checkpoints = sorted((tmp_path / "ck").glob("step-*.safetensors"))
    assert len(checkpoints) == 1, checkpoints
    stopped_at = int(checkpoints[0].stem.split("-")[1])
    assert stopped_at == reported < TOTAL  # every reported step is in the checkpoint
    stopped = tensors(tmp_path / "stopped.safetensors")
    assert stopped.keys() == tensors(checkpoints[0]).keys()
    for k, v in tensors(checkpoints[0]).items():
        np.testing.assert_array_equal(stopped[k], v)

    resumed = subprocess.run(
        run_cmd(
            "--steps",
            str(AFTER),
            "--resume",
            str(checkpoints[0]),
            "--save-state",
            str(tmp_path / "resumed.safetensors"),
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    whole = subprocess.run(
        run_cmd(
            "--steps", str(stopped_at + AFTER), "--save-state", str(tmp_path / "whole.safetensors")
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr
    a, b = tensors(tmp_path / "whole.safetensors"), tensors(tmp_path / "resumed.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # And the interruption did change something: the stopped state is not the final one.
    assert any(not np.array_equal(a[k], stopped[k]) for k in a)


def test_a_closed_stdout_stops_the_run_and_keeps_the_state(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        run_cmd("--steps", str(TOTAL), "--json", "--save-state", str(tmp_path / "s.safetensors")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith('{"step": 0')
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err
    assert "stdout was closed" in err
    assert (tmp_path / "s.safetensors").exists()


def test_resume_from_another_bundles_checkpoint_needs_the_flag(tmp_path: Path) -> None:
    from stepbundle.runtime.state.checkpoint import (
        CheckpointMeta,
        checkpoint_digest,
        write_safetensors,
    )

    # No signal or pipe here: the three runs go through stepbundle.cli.main in this
    # process (cli_here), without a child's jax import each.
    first = cli_here(
        *run_cmd("--steps", "3", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "3")[3:]
    )
    assert first.returncode == 0, first.stderr
    ckpt = tmp_path / "step-00000003.safetensors"
    values, meta = read_safetensors(ckpt)
    info = json.loads(meta["stepbundle"])
    foreign = "sha256:" + "ab" * 32  # as if the same model had been re-exported
    info["bundle_digest"] = foreign
    # Signed again, as the writer of a re-exported bundle's checkpoint would have.
    info["sha256"] = checkpoint_digest(CheckpointMeta.from_json(ckpt, json.dumps(info)), values)
    moved = tmp_path / "moved.safetensors"
    write_safetensors(moved, values, {**meta, "stepbundle": json.dumps(info)})
    refused = cli_here(*run_cmd("--steps", "2", "--resume", str(moved))[3:])
    assert refused.returncode == 1
    assert foreign in refused.stderr and "--allow-other-bundle" in refused.stderr
    allowed = cli_here(
        *run_cmd("--steps", "2", "--resume", str(moved), "--allow-other-bundle", "--json")[3:]
    )
    assert allowed.returncode == 0, allowed.stderr
    assert [json.loads(line)["step"] for line in allowed.stdout.splitlines()] == [3, 4]
