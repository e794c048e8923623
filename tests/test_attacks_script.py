"""scripts/attacks.py lists every attack module's attacks, and reports an attack that
fails, one that raises something else and one that hangs (its process group killed) as
failed, with exit 1.

The real attacks take minutes; CI runs them all in scripts/test.sh. Here the runner's
``--module`` adds a module of made-up attacks, and ``--only`` keeps just those.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "attacks.py"
EXPECTED = {
    "run_outputs": 8,
    "urls_store": 9,
    "sinks_data": 6,
    "round_four": 9,
}  # at least, per module

MADE_UP = """
import os, subprocess, sys, time


def passes(folder):
    (folder / "x").write_text("an empty folder of its own")


def fails(folder):
    raise AssertionError("the refusal does not say 'Choose'")


def errors(folder):
    raise ValueError("not an assertion")


def hangs(folder):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["MADE_UP_PID_FILE"], "w") as f:
        f.write(str(child.pid))
    time.sleep(600)


def attacks():
    return [("passes", passes), ("fails", fails), ("errors", errors), ("hangs", hangs)]
"""


def attacks(
    python: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_list_names_every_modules_attacks(lean_python: str) -> None:
    out = attacks(lean_python, "--list")
    assert out.returncode == 0, out.stderr[-3000:]
    names = out.stdout.splitlines()
    per_module = Counter(name.split(": ", 1)[0] for name in names)
    for module, least in EXPECTED.items():
        assert per_module[module] >= least, f"{module}: {per_module[module]} attacks listed"
    assert len(set(names)) == len(names)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie nobody has reaped yet counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def test_failures_and_a_hang_are_reported_with_exit_1(lean_python: str, tmp_path: Path) -> None:
    module = tmp_path / "made_up.py"
    module.write_text(MADE_UP)
    pid_file = tmp_path / "grandchild.pid"
    listed = attacks(lean_python, "--list", "--module", str(module), "--only", "made_up")
    names = ["passes", "fails", "errors", "hangs"]
    assert listed.stdout.splitlines() == [f"made_up: {n}" for n in names]

    out = attacks(
        lean_python, "--module", str(module), "--only", "made_up", "--timeout", "5",
        env={"MADE_UP_PID_FILE": str(pid_file)},
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines() if "  made_up: " in line]
    outcomes = {words[-1]: words[0] for words in lines}  # "FAILED  0.1 s  made_up: fails"
    assert outcomes == {"passes": "passed", "fails": "FAILED", "errors": "ERROR", "hangs": "HUNG"}
    assert "AssertionError: the refusal does not say 'Choose'" in out.stdout
    assert "ValueError: not an assertion" in out.stdout
    assert "still running after 5 s; its process group was killed" in out.stdout
    assert out.stdout.splitlines()[-1] == "1 passed, 3 failed"

    # The hung attack's own child went with its process group.
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(grandchild), f"the hung attack's child {grandchild} still runs"
