"""The export's progress line on a terminal (issue #40): whole lines ("captured ...",
"wrote ...", an error) never land inside the tqdm bar, and a stage that runs the user's
code (a capture) says how far it is from a thread of its own.

A pseudo-terminal (``pty``) stands for the user's terminal; ``_screen`` replays what was
written to it as a terminal shows it (a carriage return goes back to the line's start).
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from stepbundle.frontend import progress
from stepbundle.frontend.progress import StageLine, ticking

_CURSOR_UP = "\x1b[A"


def _screen(text: str) -> list[str]:
    """The lines a terminal shows after ``text`` (carriage returns, newlines, cursor up;
    other escape sequences dropped)."""
    text = re.sub(r"\x1b\[[0-9;]*[B-Za-z]", "", text.replace("\r\n", "\n"))
    lines, row, col = [""], 0, 0
    i = 0
    while i < len(text):
        if text.startswith(_CURSOR_UP, i):
            row, i = max(row - 1, 0), i + len(_CURSOR_UP)
            continue
        ch = text[i]
        i += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1 :]
            col += 1
    return [line.rstrip() for line in lines]


def _terminal() -> tuple[int, int]:
    """A pseudo-terminal (master, slave) of 24 rows and 120 columns, as a user's (a new
    one has 0 columns, where tqdm draws nothing)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    return master, slave


def _read_all(fd: int) -> str:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side is closed and everything was read
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


def test_whole_lines_stand_on_their_own_above_the_bar() -> None:
    master, slave = _terminal()
    with os.fdopen(slave, "w") as term:
        line = StageLine(term)
        assert line._tty  # a bar, as on the user's terminal
        line("capturing the training step (1 of 2)", 0, 1000)
        line("capturing the training step (1 of 2)", 500, 1000)
        line.write("[export] captured: 2 training steps")
        line("lowering the train program 0", 10, 100)
        line.write("[export] wrote x.stepbundle")
        line.close()
        print("stepbundle: error: the last line", file=term, flush=True)
    screen = [s for s in _screen(_read_all(master)) if s]
    assert "[export] captured: 2 training steps" in screen, screen
    assert "[export] wrote x.stepbundle" in screen, screen
    assert screen[-1] == "stepbundle: error: the last line", screen  # the bar is gone


def test_a_terminal_of_no_width_gets_plain_lines() -> None:
    # a new pty has 0 columns (script run without a terminal, some CI runners): tqdm
    # would draw nothing there, so the stage lines are printed as in a log
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as term:
        line = StageLine(term)
        assert not line._tty
        line("lowering the train program 0", 0, 100)
        line("lowering the train program 0", 50, 100)
        line.write("[export] wrote x.stepbundle")
        line.close()
    screen = [s for s in _screen(_read_all(master)) if s]
    assert screen[0] == "[export] lowering the train program 0 (100 operators) ...", screen
    assert screen[1].startswith("[export] lowering the train program 0: 50% (50/100"), screen
    assert screen[2] == "[export] wrote x.stepbundle", screen


def test_a_log_hears_of_a_stage_of_unknown_length_while_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io

    monkeypatch.setattr(progress, "UNKNOWN_LENGTH_EVERY_S", 0.0)  # every tick, not 30 s
    out = io.StringIO()
    line = StageLine(out)
    line("capturing the training step (1 of 2)", 0, None)
    line("capturing the training step (1 of 2)", 1234, None)
    line.write("[export] captured: 2 training steps")
    got = [s.rsplit(" (", 1)[0] for s in out.getvalue().splitlines()]
    assert got == [
        "[export] capturing the training step",  # "(1 of 2) ..." cut off
        "[export] capturing the training step (1 of 2): 1,234 so far",
        "[export] captured: 2 training steps",
    ], out.getvalue()


def test_ticking_counts_from_a_thread_and_keeps_the_last_count() -> None:
    ticks: list[tuple[str, int, int | None]] = []
    done = [0]
    with ticking(lambda *a: ticks.append(a), "capturing", lambda: done[0], every=0.01) as t:
        for _ in range(30):
            done[0] += 1
            time.sleep(0.005)
    assert ticks[0] == ("capturing", 0, None)
    assert ticks[-1] == ("capturing", 30, None) and t.done == 30
    counts = [d for _, d, _ in ticks]
    assert counts == sorted(counts) and len(set(counts)) > 2  # ticked while it ran
    assert not any(th.name == "stepbundle-progress" for th in threading.enumerate())


_FAILING_RECIPE = """
import torch
from stepbundle.frontend.recipe import Recipe

def step(model, opt, batch):
    loss = model(batch["x"]).square().mean()
    loss.backward()
    if loss > 0:  # a Python decision on a traced value: refused
        opt.step()
    return {"loss": loss}

def recipe():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Recipe(model, opt, step, {"x": torch.randn(8, 4)})
"""


def test_an_export_error_on_a_terminal_starts_a_line_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stepbundle.cli.main import main

    (tmp_path / "failing.py").write_text(_FAILING_RECIPE)
    master, slave = _terminal()
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.append(_read_all(master)))
    reader.start()
    with os.fdopen(slave, "w") as term:
        monkeypatch.setattr(sys, "stderr", term)  # the CLI's stderr is the terminal
        code = main(
            ["export", f"{tmp_path / 'failing.py'}:recipe", "-o", str(tmp_path / "x.stepbundle"),
             "--frontend", "torch"]
        )  # fmt: skip
        monkeypatch.undo()
    reader.join(timeout=60)
    text = read[0]
    assert code == 1, text
    screen = [s for s in _screen(text) if s]
    assert "capturing the training step (1 of 2)" in text  # a bar was drawn
    errors = [s for s in screen if "stepbundle: error:" in s]
    assert errors and all(s.startswith("stepbundle: error:") for s in errors), screen
