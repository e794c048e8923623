"""``stepbundle run``'s outputs never lose anything (issue #29, round three): a checkpoint
folder has one live run, no output is an input, outputs are kept somewhere real,
``--eval-data`` is checked before the first step, ``--save-state`` is written even when
there is nothing to do, and ``stepbundle eval`` spells its batch size as ``run`` does.

The lr that is 0 in float32 and the metrics file after a SIGKILL are in
test_run_outputs_resume.py. Everything here goes through the real CLI and file system: in a
child process where the process is the point (a live run holding a folder, killed), else
``stepbundle.cli.main`` in this one (``cli_here``: the same main, without a child's seconds
of importing jax).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import GOLDEN_DIR, cli_here, golden_bundle

from stepbundle.runtime.state.checkpoint import read_checkpoint

BUNDLE = golden_bundle("linear_adamw")
NPZ = GOLDEN_DIR / "linear_adamw.inputs.npz"


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


def make_inputs(tmp_path: Path) -> dict[str, Path]:
    """Copies of every kind of input a run reads: bundle, .npz, dataset folder, checkpoint."""
    from stepbundle.runtime import load
    from stepbundle.runtime.data.dataset_writer import write_dataset

    bundle = tmp_path / "model.stepbundle"
    bundle.write_bytes(BUNDLE.read_bytes())
    npz = tmp_path / "train.npz"
    npz.write_bytes(NPZ.read_bytes())
    with np.load(NPZ) as z:
        rows = {k: z[k].reshape(-1, *z[k].shape[2:]) for k in z.files}
    dataset = tmp_path / "val"
    write_dataset(dataset, rows, rows_per_shard=10)
    trainer = load(bundle)
    with np.load(NPZ) as z:
        trainer.step({k: z[k][0] for k in z.files})
    ckpt = tmp_path / "ckpt.safetensors"
    trainer.save_checkpoint(ckpt)
    return {"bundle": bundle, "npz": npz, "dataset": dataset, "ckpt": ckpt}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ 1: one run per folder
def test_a_checkpoint_folder_a_live_run_holds_is_refused_and_freed_by_its_death(
    tmp_path: Path,
) -> None:
    ck = tmp_path / "ck"
    metrics = tmp_path / "a.jsonl"
    base = ["run", str(BUNDLE), "--data", str(NPZ), "--checkpoint-dir", str(ck)]
    a = subprocess.Popen(
        [sys.executable, "-m", "stepbundle", *base, "--steps", "10000000"]
        + ["--checkpoint-every", "20", "--metrics-file", str(metrics)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(ck.glob("step-*.safetensors")):
            assert a.poll() is None, a.stderr.read() if a.stderr else ""
            assert time.monotonic() < deadline, "run A wrote no checkpoint in 120 s"
            time.sleep(0.05)
        first = sorted(ck.glob("step-*.safetensors"))[0]
        # B continues A's checkpoint into A's folder while A still writes there.
        b = cli_here(*base, "--steps", "3", "--resume", str(first))
        assert b.returncode == 2, b.stderr
        line = last_line(b)
        assert "another run" in line and f"process {a.pid}" in line, line
        assert "[run] loaded" not in b.stderr
        assert a.poll() is None  # A goes on
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)
        if a.stderr:
            a.stderr.close()
    kept = sorted(ck.glob("step-*.safetensors"))
    # A's lock file is left behind; its process is gone, so the folder is free again.
    assert (ck / ".stepbundle-run.lock").read_text().startswith(f"process {a.pid} on ")
    c = cli_here(*base, "--steps", "3", "--resume", str(kept[-1]))
    assert c.returncode == 0, c.stderr
    step = read_checkpoint(kept[-1])[1].step
    assert (ck / f"step-{step + 3:08d}.safetensors").exists()
    assert not (ck / ".stepbundle-run.lock").exists()  # a run that ends removes it


def test_a_refused_run_removes_none_of_the_live_run_s_temp_files(tmp_path: Path) -> None:
    """Before: the refused run swept "stale" temp files before it tried the lock, judging
    them by process id, so the live run's checkpoint in flight (written from another PID
    namespace: its id is no live process here) was deleted under it."""
    from stepbundle.schema.atomic import _HOST

    ck = tmp_path / "ck"
    base = ["run", str(BUNDLE), "--data", str(NPZ), "--checkpoint-dir", str(ck)]
    a = subprocess.Popen(
        [sys.executable, "-m", "stepbundle", *base, "--steps", "10000000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)  # fmt: skip
    in_flight = ck / f".step-00000040.safetensors.tmp-{_HOST}-{int(gone.stdout)}-0123abcd"
    try:
        deadline = time.monotonic() + 120
        while not (ck / ".stepbundle-run.lock").exists() or not in_flight.exists():
            assert a.poll() is None and time.monotonic() < deadline, "run A did not start"
            if ck.is_dir() and not in_flight.exists():
                in_flight.write_bytes(b"\0" * 1000)
            time.sleep(0.05)
        b = cli_here(*base, "--steps", "3")
        assert b.returncode == 2 and "in use by another run" in b.stderr, b.stderr
        assert in_flight.exists() and "removed" not in b.stderr
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)
    # A is dead: the next run holds the lock, so the file is a killed writer's and goes.
    c = cli_here(*base, "--steps", "1")
    assert c.returncode == 0, c.stderr
    assert not in_flight.exists() and f"removed {in_flight}" in c.stderr


@pytest.mark.parametrize("kind", ["symlink", "hard link", "fifo"])
def test_a_lock_file_that_is_a_link_is_refused_untouched(tmp_path: Path, kind: str) -> None:
    """Before: ``ln -s ../precious.txt ck/.stepbundle-run.lock`` made a run truncate
    precious.txt and write its process id into it (a hard link did the same)."""
    precious = tmp_path / "precious.txt"
    precious.write_text("precious\n")
    ck = tmp_path / "ck"
    ck.mkdir()
    lock = ck / ".stepbundle-run.lock"
    if kind == "symlink":
        lock.symlink_to("../precious.txt")
    elif kind == "hard link":
        os.link(precious, lock)
    else:
        os.mkfifo(lock)
    r = cli_here("run", str(BUNDLE), "--data", str(NPZ), "--steps", "1",
                 "--checkpoint-dir", str(ck))  # fmt: skip
    assert r.returncode == 2, r.stderr
    line = last_line(r)
    assert f"its run lock {str(lock)!r} is" in line and "Remove it" in line, line
    assert precious.read_text() == "precious\n"
    assert not list(ck.glob("step-*")) and os.path.lexists(lock)


# ------------------------------------------------------------ 2: no output is an input
def test_every_output_that_is_an_input_is_refused_before_loading(tmp_path: Path) -> None:
    inputs = make_inputs(tmp_path)
    bundle, npz, dataset, ckpt = (str(inputs[k]) for k in ("bundle", "npz", "dataset", "ckpt"))
    index = str(Path(dataset) / "dataset.json")
    shard = str(next(p for p in Path(dataset).iterdir() if p.suffix == ".npy"))
    base = ["run", bundle, "--data", npz, "--steps", "1"]
    cases = [
        (["--metrics-file", bundle], "--metrics-file", "the bundle"),
        (["--metrics-file", npz], "--metrics-file", "--data"),
        (["--metrics-file", ckpt, "--resume", ckpt], "--metrics-file", "--resume"),
        (["--metrics-file", ckpt, "--init-from", ckpt], "--metrics-file", "--init-from"),
        (["--metrics-file", index, "--eval-data", dataset], "--metrics-file", "--eval-data"),
        (["--metrics-file", shard, "--eval-data", dataset], "--metrics-file", "--eval-data"),
        (["--save-state", ckpt, "--resume", ckpt], "--save-state", "--resume"),
        (["--save-state", index, "--eval-data", dataset], "--save-state", "--eval-data"),
        (["--checkpoint-dir", dataset, "--eval-data", dataset], "--checkpoint-dir", "--eval-data"),
        (["--tensorboard", dataset, "--eval-data", dataset], "--tensorboard", "--eval-data"),
    ]
    # Two outputs in one file: the metrics lines would end up inside the state's file.
    same = str(tmp_path / "s.out")
    cases.append((["--metrics-file", same, "--save-state", same], "--metrics-file", "--save-state"))
    # A link to the bundle is the bundle.
    link = tmp_path / "link.jsonl"
    link.symlink_to(bundle)
    cases.append((["--metrics-file", str(link)], "--metrics-file", "the bundle"))
    for flags, output, source in cases:
        before = snapshot(tmp_path)
        result = cli_here(*base, *flags)
        assert result.returncode == 2, (flags, result.stderr)
        line = last_line(result)
        assert line.startswith(f"stepbundle: error: {output} "), (flags, line)
        assert source in line and "Choose" in line, (flags, line)
        assert "[run] loaded" not in result.stderr
        assert snapshot(tmp_path) == before, flags  # nothing written, nothing changed
    # Resuming into the folder that holds the checkpoint is still the normal thing to do.
    ok = cli_here(
        *base,
        "--resume",
        ckpt,
        "--checkpoint-dir",
        str(tmp_path),
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
    )
    assert ok.returncode == 0, ok.stderr


# ------------------------------------------------------ 4: outputs are kept somewhere real
@pytest.mark.parametrize(
    "flags",
    [
        ["--checkpoint-dir", "memory://run-a"],
        ["--save-state", "memory://run-a/final.safetensors"],
        ["--checkpoint-dir", "simplecache::memory://run-a"],
    ],
)
def test_a_process_local_file_system_is_refused_as_an_output(flags: list[str]) -> None:
    result = cli_here("run", str(BUNDLE), "--data", str(NPZ), "--steps", "2", *flags)
    assert result.returncode == 2, result.stderr
    line = last_line(result)
    assert "memory://" in line and "only in this process" in line, line
    assert "e.g. runs/" in line, line  # the fix names a real path
    assert "[run] loaded" not in result.stderr


def test_a_url_whose_file_system_fails_to_start_is_one_sentence() -> None:
    """Before: ``stepbundle: error: /x`` (fsspec's FileNotFoundError, as it was)."""
    url = "reference::memory://x"
    result = cli_here("run", str(BUNDLE), "--data", str(NPZ), "--steps", "1",
                      "--checkpoint-dir", url)  # fmt: skip
    assert result.returncode == 2, result.stderr
    line = last_line(result)
    assert f"fsspec could not open {url!r} as a file system" in line, line
    assert "reference:: needs a references file" in line, line


# --------------------------------------------- 9: --eval-data is read before the first step
@pytest.mark.parametrize("kind", ["missing folder", "not an npz", "dataset without index"])
def test_eval_data_is_refused_before_the_first_step(tmp_path: Path, kind: str) -> None:
    bad = tmp_path / "val"
    if kind == "not an npz":
        bad = tmp_path / "val.npz"
        bad.write_text("not a zip")
    elif kind == "dataset without index":
        bad.mkdir()
    result = cli_here(
        "run", str(BUNDLE), "--data", str(NPZ), "--json", "--steps", "4",
        "--eval-every", "3", "--eval-data", str(bad),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""  # no step ran
    line = last_line(result)
    assert line.startswith(f"stepbundle: error: cannot read --eval-data {str(bad)!r}"), line
    assert "[run] loaded" not in result.stderr


# ------------------------------------- 20: --save-state when --until-step is already reached
def test_save_state_is_written_when_until_step_is_already_reached(tmp_path: Path) -> None:
    first = tmp_path / "first.safetensors"
    base = ["run", str(BUNDLE), "--data", str(NPZ)]
    assert cli_here(*base, "--steps", "2", "--save-state", str(first)).returncode == 0
    again = tmp_path / "again.safetensors"
    result = cli_here(
        *base, "--until-step", "2", "--resume", str(first), "--save-state", str(again)
    )
    assert result.returncode == 0, result.stderr
    assert "nothing to do" in result.stderr and f"wrote state to {again}" in result.stderr
    want_values, want_meta = read_checkpoint(first)
    values, meta = read_checkpoint(again)
    assert meta.step == want_meta.step == 2
    assert values.keys() == want_values.keys()
    for name, v in values.items():
        np.testing.assert_array_equal(v, want_values[name])


# ----------------------------------------------------- 23: one name for the eval batch size
def test_eval_takes_the_eval_batch_size_under_run_s_name(tmp_path: Path) -> None:
    inputs = make_inputs(tmp_path)
    base = ["eval", str(inputs["bundle"]), "--data", str(inputs["dataset"]), "--json"]
    new = cli_here(*base, "--eval-batch-size", "5")
    assert new.returncode == 0, new.stderr
    assert "deprecated" not in new.stderr
    old = cli_here(*base, "--batch-size", "5")
    assert old.returncode == 0, old.stderr
    notes = [line for line in old.stderr.splitlines() if "--batch-size" in line]
    assert notes == [
        "stepbundle: note: `stepbundle eval --batch-size` is deprecated; it is now "
        "--eval-batch-size, as in `stepbundle run` (the old name goes in 0.3)."
    ], old.stderr
    assert json.loads(new.stdout) == json.loads(old.stdout)
    assert json.loads(new.stdout)["rows"] == 24
    default = cli_here(*base)
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout)["rows"] == 24
    # The batch size is used, not only accepted: 24 rows are 5 batches of 5 (the last
    # padded), and 3 of the bundle's own 8 without the option. The plain line says so.
    plain = [arg for arg in base if arg != "--json"]
    for flags, batches in ((["--eval-batch-size", "5"], 5), (["--batch-size", "5"], 5), ([], 3)):
        r = cli_here(*plain, *flags)
        assert r.returncode == 0, r.stderr
        assert r.stdout.rstrip().endswith(f"(24 rows, {batches} batches)"), (flags, r.stdout)
    help_text = cli_here("eval", "--help").stdout
    assert "--eval-batch-size" in help_text and "--batch-size" not in help_text.replace(
        "--eval-batch-size", ""
    )
    assert os.path.exists(inputs["bundle"])
