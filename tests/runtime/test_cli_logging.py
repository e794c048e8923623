"""``stepbundle run``'s reporting: the progress bar, --log-every, --metrics-file and
--tensorboard. The bar is checked on a simulated terminal (carriage return overwrites,
nothing clears), event files with a TFRecord reader written here from the format."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_helpers import GOLDEN_DIR, cli_here, drain_terminal, golden_batches, golden_bundle

from stepbundle.cli.main import main
from stepbundle.cli.progress import ProgressBar
from stepbundle.cli.report import Reporter
from stepbundle.runtime import load

BUNDLE = str(golden_bundle("batchnorm_lr"))  # has an lr hyperparameter
DATA = str(GOLDEN_DIR / "batchnorm_lr.inputs.npz")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepbundle", "run", BUNDLE, "--data", DATA, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def cli_in(*args: str) -> subprocess.CompletedProcess[str]:
    """``cli(ARGS)`` in this process (``cli_here``, the same main): for the tests where a
    child process is not the point, a jax import saved per command."""
    return cli_here("run", BUNDLE, "--data", DATA, *args)


def strict_json(line: str) -> dict[str, Any]:
    def refuse(token: str) -> Any:
        raise AssertionError(f"non-standard JSON token {token} in {line!r}")

    obj = json.loads(line, parse_constant=refuse)
    assert isinstance(obj, dict)
    return obj


def api_steps(n: int) -> list[dict[str, float]]:
    """Loss and lr of the first ``n`` steps, through the Python API."""
    t = load(BUNDLE)
    out = []
    for m in t.run(golden_batches("batchnorm_lr"), n):
        out.append({"loss": float(m["loss"]), "lr": t.hyperparameters["lr"]})
    return out


# ------------------------------------------------------------------ the terminal
def screen(text: str) -> list[str]:
    """The lines a terminal shows after ``text``: '\\r' returns to column 0 and later
    characters overwrite earlier ones; nothing is erased unless overwritten."""
    lines: list[list[str]] = [[]]
    col = 0
    for ch in text:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append([])
            col = 0
        else:
            line = lines[-1]
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    return ["".join(line) for line in lines]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_terminal_model_shows_the_reported_bug() -> None:
    # The old bar: '\r' and the new text, no padding. The model must show the stale digit.
    assert screen("\rloss 1.88225\rloss 1.8296") == ["loss 1.82965"]


def test_a_shorter_number_leaves_no_stale_digits() -> None:
    term = FakeTerminal()
    bar = ProgressBar(0, 10, term)
    bar.update(3, {"loss": 1.88225, "accuracy": 0.5}, None)
    bar.update(5, {"loss": 1.8296, "accuracy": 0.5}, 0.001)
    bar.update(6, {"loss": 1.8296}, None)  # a shorter line still
    text = term.getvalue()
    shown = screen(text)[-1]
    last_drawn = text.rsplit("\r", 1)[-1]
    assert shown.rstrip() == last_drawn.rstrip()
    assert "loss 1.8296" in shown and "1.82965" not in shown
    assert "accuracy" not in shown and "lr" not in shown
    assert "6/10" in shown
    bar.close()
    assert term.getvalue().endswith("\n")


class CountedReads:
    """A metric that counts how often it is read (turned into an array)."""

    reads = 0

    def __init__(self, value: float) -> None:
        self.value = value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        CountedReads.reads += 1
        return np.asarray(self.value, dtype=dtype)


def reporter(tmp: Path | None = None, **kw: Any) -> Reporter:
    args: dict[str, Any] = {
        "first_step": 0,
        "steps": 1000,
        "json_lines": False,
        "log_every": None,
        "metrics_file": None,
        "tensorboard": None,
        "writes_files": True,
        "hyperparameters": lambda: {"param_groups.0.lr": 0.5, "param_groups.1.lr": 0.1},
        "stdout": io.StringIO(),
        "stderr": FakeTerminal(),
    }
    args.update(kw)
    return Reporter(**args)


def run_steps(rep: Reporter, n: int, first: int = 0) -> None:
    with rep:
        for i in range(n):
            rep.step(i, first + i, {"loss": CountedReads(1.0 / (i + 1))}, last=i + 1 == n)


def test_the_bar_reads_metrics_only_at_refresh_points() -> None:
    CountedReads.reads = 0
    err = FakeTerminal()
    run_steps(reporter(stderr=err), 1000)
    # About ten reads a second; a loop of 1000 empty steps takes far less than a second.
    assert 2 <= CountedReads.reads < 50
    shown = screen(err.getvalue())[-2]
    assert "1000/1000" in shown and "loss 0.001" in shown and "lr 0.5" in shown


def test_plain_lines_without_a_terminal() -> None:
    CountedReads.reads = 0
    out = io.StringIO()
    run_steps(reporter(stdout=out, stderr=io.StringIO(), steps=20), 20)
    lines = out.getvalue().splitlines()
    assert [int(line.split()[1]) for line in lines] == [0, *range(1, 20, 2)]
    assert lines[1] == "step      1  loss 0.500000  lr 0.5"
    assert CountedReads.reads == len(lines)  # steps nobody reports are never read


def test_log_every_selects_global_steps_and_the_last() -> None:
    out = io.StringIO()
    rep = reporter(stdout=out, stderr=io.StringIO(), json_lines=True, log_every=4, steps=7)
    run_steps(rep, 7, first=10)
    assert [json.loads(line)["step"] for line in out.getvalue().splitlines()] == [11, 15, 16]


def test_other_processes_of_a_job_report_nothing(tmp_path: Path) -> None:
    CountedReads.reads = 0
    out, err = io.StringIO(), FakeTerminal()
    rep = reporter(
        writes_files=False,
        json_lines=True,
        stdout=out,
        stderr=err,
        metrics_file=str(tmp_path / "m.jsonl"),
        tensorboard=str(tmp_path / "tb"),
    )
    run_steps(rep, 10)
    assert CountedReads.reads == 0 and out.getvalue() == "" and err.getvalue() == ""
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "tb").exists()


def test_the_metrics_file_is_strict_json_with_non_finite_values(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rep = reporter(stderr=io.StringIO(), metrics_file=str(path))
    with rep:
        rep.step(0, 0, {"loss": np.float32(np.nan), "step": np.int32(7)}, last=False)
        rep.step(1, 1, {"loss": np.float32(-np.inf), "step": np.int32(8)}, last=True)
    lines = [strict_json(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"], r["metric.step"]) for r in lines] == [
        (0, "NaN", 7.0),
        (1, "-Infinity", 8.0),
    ]
    assert all(r["lr"] == 0.5 for r in lines)  # the first param group's lr
    assert all(isinstance(r["time"], float) and r["time"] >= 0 for r in lines)


# ------------------------------------------------------------------ the CLI
def test_the_cli_draws_a_bar_on_a_terminal() -> None:
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    cmd = [sys.executable, "-m", "stepbundle", "run", BUNDLE, "--data", DATA]
    proc = subprocess.Popen(
        [*cmd, "--steps", "40", "--log-every", "20"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=terminal,
    )
    os.close(terminal)
    received = drain_terminal(controller)
    assert proc.stdout is not None
    stdout = proc.stdout.read().decode()
    assert proc.wait(timeout=300) == 0
    shown = screen(received.decode().replace("\r\n", "\n"))
    bars = [line for line in shown if "40/40" in line]
    assert bars and "step/s" in bars[-1] and "loss " in bars[-1] and "lr 0.01" in bars[-1]
    # --log-every's plain lines go to stdout, the bar stays on the terminal.
    assert [line.split()[:2] for line in stdout.splitlines()] == [["step", "19"], ["step", "39"]]
    assert "|" not in stdout


def read_tfrecords(path: Path) -> Iterator[bytes]:
    """The records of a TFRecord file: length (u64), masked CRC-32C of the length, data,
    masked CRC-32C of the data; both checksums checked."""
    raw = path.read_bytes()
    pos = 0
    while pos < len(raw):
        (length,) = struct.unpack_from("<Q", raw, pos)
        (length_crc,) = struct.unpack_from("<I", raw, pos + 8)
        assert length_crc == masked_crc32c(raw[pos : pos + 8])
        data = raw[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", raw, pos + 12 + length)
        assert data_crc == masked_crc32c(data)
        yield data
        pos += 12 + length + 4
    assert pos == len(raw)


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_crc32c_oracle() -> None:
    assert masked_crc32c(b"") != 0
    crc = 0xFFFFFFFF
    for b in b"123456789":
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    assert crc ^ 0xFFFFFFFF == 0xE3069283  # the CRC-32C check value


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    (events,) = logdir.glob("events.out.tfevents.*")
    for record in read_tfrecords(events):
        event = Event()
        event.ParseFromString(record)
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_json_metrics_file_and_tensorboard_agree_with_the_api(tmp_path: Path) -> None:
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    out = cli(
        "--steps", "5", "--log-every", "2", "--json",
        "--metrics-file", str(metrics), "--tensorboard", str(tb),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    want = api_steps(5)
    printed = [strict_json(line) for line in out.stdout.splitlines()]
    assert [r["step"] for r in printed] == [1, 3, 4]
    written = [strict_json(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in written] == [1, 3, 4]
    assert set(written[0]) == {"step", "time", "lr", "loss"}
    for r, p in zip(written, printed, strict=True):
        assert r["loss"] == p["loss"] == pytest.approx(want[r["step"]]["loss"], rel=1e-6)
        assert r["lr"] == want[r["step"]]["lr"]
    assert [r["time"] for r in written] == sorted(r["time"] for r in written)

    summaries = scalars(tb)
    assert set(summaries) == {"train/loss", "hyperparameters/lr"}
    assert [s for s, _ in summaries["train/loss"]] == [1, 3, 4]
    assert [v for _, v in summaries["train/loss"]] == pytest.approx(
        [r["loss"] for r in written], rel=1e-6
    )
    assert [v for _, v in summaries["hyperparameters/lr"]] == pytest.approx([0.01] * 3)


def test_a_resumed_run_continues_the_metrics_file_at_the_checkpoints_step(
    tmp_path: Path,
) -> None:
    # Assumes --steps counts the steps of this run (after --resume, the steps added).
    whole, parts, ck = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl", tmp_path / "ck"
    common = ("--log-every", "2")
    done = cli_in("--steps", "6", "--metrics-file", str(whole), *common)
    assert done.returncode == 0, done.stderr
    first = cli_in(
        "--steps", "4", "--metrics-file", str(parts), "--checkpoint-dir", str(ck),
        "--checkpoint-every", "4", *common,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    second = cli_in(
        "--steps", "2", "--metrics-file", str(parts),
        "--resume", str(ck / "step-00000004.safetensors"), *common,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    a = [strict_json(line) for line in whole.read_text().splitlines()]
    b = [strict_json(line) for line in parts.read_text().splitlines()]
    assert [r["step"] for r in b] == [r["step"] for r in a] == [1, 3, 5]
    assert [(r["loss"], r["lr"]) for r in b] == [(r["loss"], r["lr"]) for r in a]


def test_every_checkpoint_written_is_said_once(tmp_path: Path) -> None:
    """Periodic checkpoints were written silently (only the final one was said); each is
    now one line on stderr, the final one too, and stdout keeps the JSON records only."""
    ck = tmp_path / "ck"
    r = cli_in("--steps", "5", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--json")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("[run] wrote checkpoint")]
    names = [f"step-{n:08d}.safetensors" for n in (2, 4, 5)]
    assert said == [f"[run] wrote checkpoint {ck / name}" for name in names], r.stderr
    assert sorted(p.name for p in ck.glob("step-*")) == names
    assert [strict_json(line)["step"] for line in r.stdout.splitlines()] == [0, 1, 2, 3, 4]


def test_a_run_whose_stderr_reader_goes_away_still_writes_every_checkpoint(
    tmp_path: Path,
) -> None:
    """The checkpoint notes go to stderr: with its reader gone (a log shipper that died),
    the first note's BrokenPipeError stopped the run at its first checkpoint, where before
    the notes the run trained on and wrote every checkpoint (a reviewer's finding)."""
    ck, out = tmp_path / "ck", tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "stepbundle", "run", BUNDLE, "--data", DATA, "--steps", "3000",
            "--checkpoint-dir", str(ck), "--checkpoint-every", "500", "--json"]  # fmt: skip
    with out.open("w") as stdout:
        child = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, text=True)
        assert child.stderr is not None
        for line in child.stderr:
            if line.startswith("[run] loaded"):
                break  # loaded: the steps are about to start
        child.stderr.close()  # the reader goes away before the first checkpoint
        child.wait(timeout=600)
    names = [f"step-{n:08d}.safetensors" for n in range(500, 3001, 500)]
    assert sorted(p.name for p in ck.glob("step-*")) == names
    assert len(out.read_text().splitlines()) == 3000


def test_refusals_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["run", BUNDLE, "--data", DATA, "--steps", "1"]
    assert main([*base, "--metrics-file", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main([*base, "--tensorboard", str(tmp_path / "file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    assert main([*base, "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert "pip install 'stepbundle[tensorboard]'" in err and "Traceback" not in err
    assert not (tmp_path / "tb").exists()


# ------------------------------------------------------------- dataset folders
def _dataset(name: str, tmp_path: Path) -> Path:
    """The golden inputs of ``name`` as a dataset folder (3 batches' rows)."""
    from stepbundle.runtime.data.dataset_writer import write_dataset

    with np.load(GOLDEN_DIR / f"{name}.inputs.npz") as z:
        rows = {k: v.reshape(-1, *v.shape[2:]) for k, v in z.items()}
    out = tmp_path / name
    write_dataset(str(out), rows)
    return out


def test_the_last_step_is_reported_when_the_data_ends_first(tmp_path: Path) -> None:
    """--epochs 1 over 3 batches with --steps 100: the run stops after step 2, and that
    step is the last one logged, whatever --log-every says (it was never reported)."""
    data = _dataset("batchnorm_lr", tmp_path)
    r = cli_here("run", BUNDLE, "--data", str(data), "--steps", "100", "--epochs", "1",
                 "--no-shuffle", "--log-every", "10", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [strict_json(line)["step"] for line in r.stdout.splitlines()] == [2]
    assert "the data ended after 3 steps" in r.stderr


def test_eval_entry_over_an_endless_dataset_takes_steps_batches(tmp_path: Path) -> None:
    """`run --entry eval` on a dataset folder without --epochs read the endless loader
    into a list (it never returned); --steps batches are evaluated, one line each."""
    data = _dataset("linear_adamw", tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "stepbundle", "run", str(golden_bundle("linear_adamw")),
         "--data", str(data), "--entry", "eval", "--steps", "5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [strict_json(line)["step"] for line in r.stdout.splitlines()] == [0, 1, 2, 3, 4]


def test_eval_data_without_an_eval_entry_is_refused_before_training(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    r = cli_in(
        "--steps", "4", "--eval-data", DATA, "--eval-every", "2", "--checkpoint-dir", str(ckpt)
    )
    assert r.returncode == 2, r.stderr
    assert "has none (its entries: train)" in r.stderr
    assert "Recipe(eval_step=...)" in r.stderr
    assert r.stdout == "" and not any(ckpt.glob("*"))  # no step ran, nothing written
