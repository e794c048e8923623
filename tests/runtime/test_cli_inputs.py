"""The CLI refuses bad arguments and bad data files with one line and a documented exit
code, before it loads or compiles anything; a closed stdout ends quietly."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import GOLDEN_DIR, cli_here, golden_bundle


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command in a child process (``python -m stepbundle``). Refusals made before
    anything loads run in this process instead (``cli_here``): the same ``main``, without a
    jax import per case."""
    return subprocess.run(
        [sys.executable, "-m", "stepbundle", *args], capture_output=True, text=True, timeout=300
    )


def run_args(*extra: str, data: str | None = None) -> list[str]:
    return [
        "run",
        str(golden_bundle("linear_adamw")),
        "--data",
        data or str(GOLDEN_DIR / "linear_adamw.inputs.npz"),
        *extra,
    ]


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr
    return lines[-1]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["--steps", "-1"], "argument --steps: must be at least 1, got -1"),
        (["--steps", "two"], "argument --steps: expected a whole number, got 'two'"),
        (["--steps", "2", "--checkpoint-every", "-1"], "--checkpoint-every: must be at least 1"),
        (["--steps", "2", "--pack-state", "-5"], "--pack-state: must be at least 0, got -5"),
        (["--steps", "2", "--set", "lr=abc"], "--set: lr='abc': 'abc' is not a number"),
        (["--steps", "2", "--set", "lr=nan"], "--set: lr=nan: a hyperparameter must be finite"),
        (["--steps", "2", "--set", "lr"], "--set: expected NAME=VALUE, got 'lr'"),
        (["--steps", "2", "--devices", "0"], "--devices: needs at least 1 device, got 0"),
        (["--steps", "2", "--expect-digest", "abc"], "--expect-digest: expected sha256:<64 hex"),
    ],
)
def test_bad_arguments_are_refused_while_parsing(flags: list[str], needle: str) -> None:
    result = cli_here(*run_args(*flags))
    assert result.returncode == 2
    assert needle in one_line_error(result)
    assert "[run] loaded" not in result.stderr  # nothing was loaded


def test_a_digest_is_accepted_with_or_without_its_prefix() -> None:
    digest = (
        cli_here("inspect", str(golden_bundle("linear_adamw"))).stdout.splitlines()[1].split()[1]
    )
    assert digest.startswith("sha256:")
    for given in (digest, digest.removeprefix("sha256:"), digest.upper().replace("SHA256:", "")):
        result = cli_here(*run_args("--steps", "1", "--expect-digest", given))
        assert result.returncode == 0, result.stderr
    other = "sha256:" + "0" * 64
    result = cli_here(*run_args("--steps", "1", "--expect-digest", other))
    assert result.returncode == 1
    assert other in one_line_error(result)


def _npz(path: Path, **arrays: np.ndarray) -> str:
    np.savez(path, **arrays)
    return str(path)


def test_bad_data_files_are_refused_in_one_line(tmp_path: Path) -> None:
    good = np.load(GOLDEN_DIR / "linear_adamw.inputs.npz")
    npy = tmp_path / "x.npy"
    np.save(npy, good["x"])
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    whole = (GOLDEN_DIR / "linear_adamw.inputs.npz").read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(whole[: len(whole) // 2])
    zero = _npz(tmp_path / "zero.npz", x=good["x"][:0], y=good["y"][:0])
    cases = {
        str(tmp_path / "missing.npz"): "No such file",
        str(npy): "Stacked batches go in an .npz",
        str(empty): "it is not an .npz archive",
        str(truncated): "cannot read --data",
        zero: "it holds 0 batches",
    }
    for path, needle in cases.items():
        result = cli_here(*run_args("--steps", "1", data=path))
        assert result.returncode == 2, (path, result.stderr)
        line = one_line_error(result)
        assert line.startswith(f"stepbundle: error: cannot read --data {path!r}")
        assert needle in line, (path, line)


def test_a_header_that_declares_more_than_the_file_holds(tmp_path: Path) -> None:
    # An .npy member whose header claims 343 GB: refused from the header, never allocated.
    header = np.lib.format.header_data_from_array_1_0(np.zeros((1,), np.float32))
    header["shape"] = (10_000_000, 8_575)
    member = tmp_path / "x.npy"
    with open(member, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(b"\0" * 64)
    hostile = tmp_path / "hostile.npz"
    with zipfile.ZipFile(hostile, "w") as z:
        z.write(member, "x.npy")
    result = cli_here(*run_args("--steps", "1", data=str(hostile)))
    assert result.returncode == 2
    line = one_line_error(result)
    assert "x.npy declares (10000000, 8575) float32 (343000000000 bytes)" in line
    assert "the file is damaged" in line


def test_a_closed_stdout_ends_quietly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "stepbundle", *run_args("--steps", "400", "--json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    assert first.startswith('{"step": 0')
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_outputs_that_would_destroy_an_input_are_refused_before_loading(tmp_path: Path) -> None:
    bundle = tmp_path / "b.stepbundle"
    bundle.write_bytes(golden_bundle("linear_adamw").read_bytes())
    data = tmp_path / "d.npz"
    data.write_bytes((GOLDEN_DIR / "linear_adamw.inputs.npz").read_bytes())
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cases = {
        str(bundle): "is the bundle; writing it would destroy an input",
        str(data): "is --data; writing it would destroy an input",
        str(tmp_path): "is a folder; give a file name",
        str(blocker / "state.safetensors"): "--save-state: cannot write into",
    }
    for target, needle in cases.items():
        before = bundle.read_bytes(), data.read_bytes()
        result = cli_here(
            "run", str(bundle), "--data", str(data), "--steps", "1", "--save-state", target
        )
        assert result.returncode == 2, (target, result.stderr)
        assert needle in one_line_error(result), target
        assert "[run] loaded" not in result.stderr
        assert (bundle.read_bytes(), data.read_bytes()) == before


def test_a_checkpoint_folder_with_checkpoints_needs_resume(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    first = cli(*run_args("--steps", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"))
    assert first.returncode == 0, first.stderr
    written = (ck / "step-00000002.safetensors").read_bytes()
    again = cli_here(
        *run_args("--steps", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
    )
    assert again.returncode == 2
    line = one_line_error(again)
    assert "already holds checkpoints (step-00000002.safetensors and 0 more)" in line
    assert f"Continue with --resume {ck} (its latest checkpoint)" in line
    assert (ck / "step-00000002.safetensors").read_bytes() == written
    # What the message says to do works.
    resumed = cli(
        *run_args(
            "--steps",
            "2",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "2",
            "--resume",
            str(ck),
        )  # fmt: skip
    )
    assert resumed.returncode == 0, resumed.stderr
    assert (ck / "step-00000004.safetensors").exists()


def test_temp_files_of_killed_writers_are_cleaned_at_start(tmp_path: Path) -> None:
    """Under the folder's lock no writer is live there, so every checkpoint temp file is
    a killed writer's, whatever process id it names (one may be another PID namespace's,
    or another machine's on a shared folder); see also test_run_outputs.py's refused run,
    which removes none."""
    from stepbundle.schema.atomic import _HOST

    ck = tmp_path / "ck"
    ck.mkdir()
    stale = ck / f".step-00000040.safetensors.tmp-{_HOST}-{os.getpid()}-0123abcd"
    stale.write_bytes(b"\0" * 1000)
    remote = ck / ".step-00000040.safetensors.tmp-other_host-12-0123abcd"
    remote.write_bytes(b"\0" * 10)
    # The older naming (mkstemp's): removed once an hour old, kept while it may be live
    # (older versions take no lock).
    old_legacy = ck / ".step-00000020.safetensors.abcd1234.tmp"
    old_legacy.write_bytes(b"\0" * 10)
    os.utime(old_legacy, (0, 0))
    new_legacy = ck / ".step-00000030.safetensors.efgh5678.tmp"
    new_legacy.write_bytes(b"\0" * 10)
    result = cli(*run_args("--steps", "1", "--checkpoint-dir", str(ck)))
    assert result.returncode == 0, result.stderr
    assert not stale.exists() and not remote.exists() and not old_legacy.exists()
    assert new_legacy.exists()
    assert f"removed {stale}" in result.stderr


def test_a_missing_bundle_or_a_symlink_loop_is_one_line(tmp_path: Path) -> None:
    loop_a, loop_b = tmp_path / "a.stepbundle", tmp_path / "b.stepbundle"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    data = str(GOLDEN_DIR / "linear_adamw.inputs.npz")
    for bundle, reason in (
        (tmp_path / "missing.stepbundle", "No such file or directory"),
        (loop_a, "Too many levels of symbolic links"),
    ):
        for args in (
            ["run", str(bundle), "--data", data, "--steps", "1"],
            ["inspect", str(bundle)],
            ["eval", str(bundle), "--data", data],
        ):
            result = cli_here(*args)
            assert result.returncode == 2, (args, result.stderr)
            assert one_line_error(result).endswith(f"{str(bundle)!r}: {reason}.")
        verify = cli_here("verify", str(bundle))
        assert verify.returncode == 1 and reason in verify.stdout


def test_a_batch_with_non_string_keys_is_a_binding_error() -> None:
    from stepbundle.runtime import BindingError, load

    t = load(golden_bundle("linear_adamw"))
    x = np.zeros((8, 5), np.float32)
    y = np.zeros((8, 3), np.float32)
    with pytest.raises(BindingError, match="Batch input names are strings"):
        t.step({1: x, "y": y})


def test_thousands_of_virtual_cpu_devices_are_refused_at_once() -> None:
    result = cli(*run_args("--steps", "1", "--devices", "8000"))
    assert result.returncode == 2
    assert "at most 256 are allowed" in one_line_error(result)
    assert "[run] loaded" not in result.stderr
    # eval takes --devices too, under the same cap
    data = str(GOLDEN_DIR / "linear_adamw.inputs.npz")
    result = cli("eval", str(golden_bundle("linear_adamw")), "--data", data, "--devices", "8000")
    assert result.returncode == 2
    assert "at most 256 are allowed" in one_line_error(result)


@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
def test_a_run_refused_for_its_data_creates_no_output(tmp_path: Path, flag: str) -> None:
    """The data are read before any output folder or file is made: a refused run leaves
    the disk as it found it."""
    missing = str(tmp_path / "nope")
    extra = ["--checkpoint-dir", str(tmp_path / "ck"), "--metrics-file",
             str(tmp_path / "runs" / "a" / "m.jsonl"), "--tensorboard", str(tmp_path / "tb")]  # fmt: skip
    if flag == "--eval-data":
        extra += ["--eval-data", missing, "--eval-every", "2"]
    result = cli_here(*run_args("--steps", "4", *extra, data=missing if flag == "--data" else None))
    assert result.returncode == 2
    assert f"cannot read {flag} '{missing}'" in one_line_error(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
