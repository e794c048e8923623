"""The attack runner: every attack of issue #29, each performed for real.

    .venv-lean/bin/python scripts/attacks.py                   # all of them, 2 at a time
    .venv-lean/bin/python scripts/attacks.py --only urls_store --jobs 1
    .venv-lean/bin/python scripts/attacks.py --list
    .venv-lean/bin/python scripts/attacks.py --rounds 5 --seed 7  # a soak: 5 shuffled passes

The attacks are in the modules scripts/attacks/*.py; each exposes
``attacks() -> [(name, function(folder)), ...]``, and each function performs one attack
in the empty folder it is given and raises ``AssertionError`` unless the outcome is the
clean refusal or the correct result. An attack is named here by its module and its own
name (``urls_store: 11 malformed sha256 digest``); ``--only`` picks the attacks whose
name holds a string.

The modules are loaded from their files (``importlib``, by path), never imported as a
package ``attacks``: this file and the folder share that name, and loading by path keeps
the name the modules' docstrings cite, with no ``__init__.py`` and no ``sys.path`` games.

Each attack runs in a child process (this script with ``--child``), in a new process
group and a fresh temporary folder. Past ``--timeout`` seconds the attack is a failure
(HUNG) and its whole process group is killed, so the ``stepbundle`` commands it started
go too; whatever a finished attack left running is killed the same way. An
``AssertionError`` is the attack's verdict (FAILED); any other exception or a signal is
ERROR. The attacks run in a random order drawn from ``--seed`` (printed; a new one each
run unless given), so an attack that depends on another's leftovers shows up across
runs; ``--rounds N`` runs the whole set N times, each round in a new order.

``--module PATH`` adds the attacks of one more module file; the test of this script
(tests/test_attacks_script.py) uses it to add an attack that fails and one that hangs.

Prints one line per attack as it ends (outcome, seconds, name), then each failure's
output, then ``N passed, M failed`` alone on the last line. Exits 1 if any failed, 2 on
bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
MODULES = HERE / "attacks"
POLL_S = 0.05


@dataclass(frozen=True)
class Attack:
    """One attack to run.

    Attributes:
        module: the file of the module that lists it.
        name: its name in that module's ``attacks()``.
    """

    module: Path
    name: str

    @property
    def label(self) -> str:
        """The name printed and matched by ``--only``: the module's and the attack's."""
        return f"{self.module.stem}: {self.name}"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"stepbundle_attacks_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"Cannot load the attack module {path}: it is not a Python file.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _functions(path: Path) -> list[tuple[str, Callable[[Path], None]]]:
    found: list[tuple[str, Callable[[Path], None]]] = _load(path).attacks()
    return found


def _collect(extra: list[Path]) -> list[Attack]:
    modules = sorted(p for p in MODULES.glob("*.py") if not p.name.startswith("_"))
    found = [Attack(m, name) for m in [*modules, *extra] for name, _ in _functions(m)]
    seen: set[str] = set()
    for a in found:
        if a.label in seen:
            raise SystemExit(f"Two attacks are named {a.label!r}; rename one in {a.module}.")
        seen.add(a.label)
    return found


def _child(module: str, name: str, folder: str) -> int:
    """Run one attack in this process: 0 passed, 1 its AssertionError, 2 anything else."""
    try:
        dict(_functions(Path(module)))[name](Path(folder))
    except AssertionError as e:
        print(f"AssertionError: {e}", file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 2
    return 0


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _unmount_under(folder: Path) -> None:
    """Lazily unmount what an attack killed mid-way left mounted under ``folder`` (the
    full-disk attacks mount a tmpfs where they are allowed to)."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return
    prefix = str(folder) + os.sep
    for line in lines:
        where = line.split()[1]
        if where.startswith(prefix):
            with contextlib.suppress(OSError):  # no umount program: nothing was mounted
                subprocess.run(["umount", "-l", where], capture_output=True, check=False)


@dataclass
class _Running:
    attack: Attack
    proc: subprocess.Popen[bytes]
    folder: Path
    output: Path
    start: float


def _start(attack: Attack, root: Path, index: int) -> _Running:
    folder = root / str(index)
    (folder / "work").mkdir(parents=True)
    output = folder / "output.txt"
    with output.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(attack.module), attack.name,
             str(folder / "work")],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed whole on a hang
        )  # fmt: skip
    return _Running(attack, proc, folder, output, time.monotonic())


def _finish(r: _Running, timeout: float) -> tuple[str, str]:
    """The outcome and the output of an attack that ended or ran out of time."""
    hung = r.proc.poll() is None
    _kill_group(r.proc.pid)
    r.proc.wait()
    text = r.output.read_text(errors="replace")
    _unmount_under(r.folder)
    shutil.rmtree(r.folder, ignore_errors=True)
    if hung:
        return "HUNG", f"{text}still running after {timeout:.0f} s; its process group was killed"
    code = r.proc.returncode
    outcome = {0: "passed", 1: "FAILED"}.get(code, "ERROR")
    if code < 0:
        text += f"killed by {signal.Signals(-code).name}\n"
    return outcome, text


def _run(attacks: list[Attack], jobs: int, timeout: float) -> list[tuple[Attack, str, str]]:
    failures: list[tuple[Attack, str, str]] = []
    pending = list(enumerate(attacks))
    running: list[_Running] = []
    with tempfile.TemporaryDirectory(prefix="stepbundle-attacks-") as tmp:
        while pending or running:
            while pending and len(running) < jobs:
                index, attack = pending.pop(0)
                running.append(_start(attack, Path(tmp), index))
            time.sleep(POLL_S)
            for r in list(running):
                seconds = time.monotonic() - r.start
                if r.proc.poll() is None and seconds < timeout:
                    continue
                running.remove(r)
                outcome, text = _finish(r, timeout)
                print(f"{outcome:7s} {seconds:6.1f} s  {r.attack.label}", flush=True)
                if outcome != "passed":
                    failures.append((r.attack, outcome, text))
    return failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", metavar="SUBSTR", help="only the attacks whose name holds SUBSTR")
    p.add_argument("--jobs", type=int, default=2, help="attacks at once (default 2)")
    p.add_argument("--list", action="store_true", help="print the attacks' names and stop")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per attack (120)")
    p.add_argument("--seed", type=int, help="the seed of the order (default: a new one)")
    p.add_argument("--rounds", type=int, default=1, help="times to run the set (default 1)")
    p.add_argument(
        "--module",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="also the attacks of this module file (the script's test uses it)",
    )
    p.add_argument("--child", nargs=3, metavar=("MODULE", "NAME", "FOLDER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(*args.child)
    if args.jobs < 1 or args.rounds < 1 or args.timeout <= 0:
        p.error("--jobs and --rounds must be at least 1, and --timeout more than 0.")

    chosen = [a for a in _collect(args.module) if args.only is None or args.only in a.label]
    if not chosen:
        p.error(f"No attack's name holds {args.only!r}; --list prints them all.")
    if args.list:
        for a in chosen:
            print(a.label)
        return 0

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    order: list[Attack] = []
    for _ in range(args.rounds):
        order += rng.sample(chosen, len(chosen))
    print(
        f"stepbundle attacks: {len(chosen)} attacks x {args.rounds} round(s), "
        f"{args.jobs} at once, seed {seed} (--seed {seed} repeats this order)",
        flush=True,
    )
    t0 = time.monotonic()
    failures = _run(order, args.jobs, args.timeout)
    for attack, outcome, text in failures:
        print(f"\n{outcome} {attack.label} ({attack.module}):\n{text.rstrip()}")
    print(f"\nin {time.monotonic() - t0:.0f} s")
    print(f"{len(order) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
