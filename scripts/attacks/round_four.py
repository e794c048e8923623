"""Attacks of issue #43 (reliability round four), performed for real: each function gets
an empty folder, runs ``python -m stepbundle`` (or the runtime) as a user would (a lock
that cannot be taken, a checkpoint named for a step it does not hold, Ctrl-C while the
bundle loads and compiles, SIGTERM with a sparse --log-every, a full disk under a
periodic checkpoint, an absurd --steps-per-call, a dripping server) and raises
``AssertionError`` saying what went wrong unless the outcome is the clean refusal (exit
code, one sentence, nothing lost) or the correct result.

Run by the attack runner (``scripts/attacks.py``) with the lean environment, as
``attacks()``: ``[(name, function(folder)), ...]``.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30.0


def _golden(name: str, suffix: str = ".stepbundle") -> Path:
    """A golden file of the newest format version (``linear_adamw``, ``dropout_sgd``)."""
    folders = [p for p in (ROOT / "tests" / "golden").glob("v*.*") if p.is_dir()]
    newest = max(folders, key=lambda p: tuple(int(v) for v in re.findall(r"\d+", p.name)))
    return newest / f"{name}{suffix}"


def _base(folder: Path, name: str = "linear_adamw") -> list[str]:
    """``run`` on copies of a golden bundle and its batches (so nothing shared is at risk)."""
    bundle, data = folder / f"{name}.stepbundle", folder / f"{name}.npz"
    if not bundle.exists():
        shutil.copy(_golden(name), bundle)
        shutil.copy(_golden(name, ".inputs.npz"), data)
    return ["run", str(bundle), "--data", str(data), "--no-cache"]


def _cli(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "stepbundle", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"`{' '.join(cmd)}` still ran after {TIMEOUT_S:.0f} s") from e


def _refused(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The refusal's last stderr line, once checked: exit ``code``, no traceback, a
    sentence holding every needle."""
    err = result.stderr.strip()
    line = err.splitlines()[-1] if err else ""
    assert "Traceback" not in err, f"a traceback instead of a refusal:\n{err[-1500:]}"
    assert result.returncode == code, (
        f"expected a refusal with exit {code}, got exit {result.returncode}: {err[-800:]!r}"
    )
    for needle in needles:
        assert needle in line, f"the refusal does not say {needle!r}: {line!r}"
    return line


def lock_that_cannot_be_taken(folder: Path) -> None:
    """Item 1: a folder (or, not as root, another user's unwritable file) where the run
    lock goes refuses the run, exit 2, instead of a warning and no lock."""
    base = _base(folder)
    ck = folder / "ck"
    (ck / ".stepbundle-run.lock").mkdir(parents=True)
    r = _cli(*base, "--steps", "3", "--checkpoint-dir", str(ck))
    _refused(r, 2, "--checkpoint-dir", ".stepbundle-run.lock", "is a folder")
    assert not list(ck.glob("step-*")), "a run without its lock wrote checkpoints"
    if os.geteuid() != 0:  # root opens any file: the permission case needs a user
        ck2 = folder / "ck2"
        ck2.mkdir()
        lock = ck2 / ".stepbundle-run.lock"
        lock.write_text("process 1 on another-user's-host\n")
        lock.chmod(0o444)
        r = _cli(*base, "--steps", "3", "--checkpoint-dir", str(ck2))
        _refused(r, 2, "cannot open its run lock", "Permission denied")
        assert not list(ck2.glob("step-*")), "a run without its lock wrote checkpoints"


def _long_run(args: list[str], **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        [sys.executable, "-m", "stepbundle", *args], text=True, **kw
    )


def _wait_for(what: str, done: Callable[[], bool], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {TIMEOUT_S:.0f} s"
        time.sleep(0.02)


def checkpoint_named_for_another_step(folder: Path) -> None:
    """Item 9: --save-state ck/step-99999999.safetensors into a live run's folder is
    refused; a file of that name put there anyway does not win --resume ck, which ranks
    checkpoints by the step their metadata holds."""
    base, ck = _base(folder), folder / "ck"
    live = _long_run(
        [*base, "--steps", "100000000", "--checkpoint-dir", str(ck), "--checkpoint-every", "20"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    impostor = ck / "step-99999999.safetensors"
    try:
        _wait_for("a checkpoint", lambda: bool(list(ck.glob("step-*.safetensors"))), live)
        r = _cli(*base, "--steps", "3", "--save-state", str(impostor))
        _refused(r, 2, "--save-state", "checkpoint folder of a live run", f"process {live.pid}")
        assert not impostor.exists(), "the refused run wrote into the live run's folder"
        _wait_for("two checkpoints", lambda: len(list(ck.glob("step-*.safetensors"))) > 1, live)
    finally:
        live.kill()
        live.wait(timeout=TIMEOUT_S)
    kept = sorted(ck.glob("step-*.safetensors"))
    first, latest = kept[0], kept[-1]
    shutil.copy(first, impostor)  # what a writer that never asked leaves there
    r = _cli(*base, "--steps", "1", "--resume", str(ck), "--checkpoint-dir", str(ck))
    assert r.returncode == 0, f"--resume ck failed: {r.stderr[-1500:]}"
    assert f"resumed from {latest}" in r.stderr, (
        f"--resume ck did not take {latest.name}, the latest step held: {r.stderr[-1500:]}"
    )
    held = int(first.name[5:13])
    assert f"step-99999999.safetensors holds step {held}," in r.stderr, (
        f"the misnamed checkpoint was not named: {r.stderr[-1500:]}"
    )


def ctrl_c_while_loading(folder: Path) -> None:
    """Items 2 and 3: Ctrl-C at times spread over the load, the compiles and the automatic
    K probe (an empty compile cache) ends every run with exit 130: never a segfault
    (139), never a KeyboardInterrupt lost in a jax callback and the run going on."""
    base = _base(folder)
    # Long enough that no try ends before its signal, however fast the machine is (20,000
    # steps once finished in 0.2 s after a 1.3 s load, before a SIGINT at 3.1 s).
    cmd = [sys.executable, "-m", "stepbundle", *base, "--steps", "20000000"]
    cmd += ["--steps-per-call", "auto"]
    problems = []
    for i, delay in enumerate([1.0 + 0.3 * n for n in range(10)]):  # after the imports
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            problems.append(f"try {i} (SIGINT at {delay:.1f} s): still running after it")
            continue
        code = proc.returncode
        if code != 130 or "SIGINT" not in err or "Exception ignored" in err or "Traceback" in err:
            problems.append(f"try {i} (SIGINT at {delay:.1f} s): exit {code}: {err[-600:]!r}")
    assert not problems, "Ctrl-C did not end the run cleanly:\n" + "\n".join(problems)


SLOW = Path(__file__).resolve().parent / "data" / "slow_step"  # about 0.2 s a step here


def sigterm_with_sparse_logging(folder: Path) -> None:
    """Item 11: SIGTERM with --log-every 16 on a slow step, sent as step 15 is reported,
    stops after the step (or the call) in flight, not at step 32, the next reported one:
    the host may not run dozens of steps ahead of the device, all of which would then
    have to finish. (The stop may come a few steps later when this process is slow to
    send the signal: 8 steps of slack, at about 0.2 s a step.)"""
    ck = folder / "ck"
    for k in ("1", "2"):
        cmd = [sys.executable, "-m", "stepbundle", "run", f"{SLOW}.stepbundle", "--no-cache"]
        cmd += ["--data", f"{SLOW}.inputs.npz", "--steps", "100000", "--log-every", "16"]
        cmd += ["--json", "--steps-per-call", k, "--checkpoint-dir", str(ck / k)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        try:
            line = proc.stdout.readline()
            assert line.startswith('{"step": 15,'), f"K={k}: not step 15's line: {line!r}"
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"K={k}: still running {TIMEOUT_S:.0f} s after SIGTERM") from None
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 143 and "SIGTERM" in err, (
            f"K={k}: exit {proc.returncode}: {err[-800:]}"
        )
        final = sorted((ck / k).glob("step-*.safetensors"))
        assert final, f"K={k}: no final checkpoint: {err[-800:]}"
        at = int(final[-1].name[5:13])
        assert 16 <= at <= 24, (
            f"K={k}: SIGTERM as step 15 was reported stopped the run at step {at}, not "
            "after the step in flight"
        )


@contextlib.contextmanager
def _full_disk(where: Path, free_bytes: int) -> Iterator[bool]:
    """Mount a nearly full tmpfs at ``where`` (as sinks_data.py does); yields False
    (nothing mounted) where mounting is not allowed."""
    where.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)]
    mounted = subprocess.run(mount, capture_output=True).returncode == 0
    try:
        if mounted:
            filler = where / ".filler"
            with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)
            os.truncate(filler, max(0, filler.stat().st_size - free_bytes))
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def full_disk_under_a_periodic_checkpoint(folder: Path) -> None:
    """Item 6: the checkpoint folder fills up under periodic checkpoints; the run stops
    (exit 1), still writes --save-state on another disk, says where the state is, and
    the checkpoints written before are intact. Where no tmpfs can be mounted the
    file-size limit stands in for the full disk, for every file: then nothing can be
    saved, and the run must say so and name what is left."""
    from stepbundle.runtime.state.checkpoint import read_checkpoint

    base = _base(folder)
    out = folder / "final.safetensors"

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    with _full_disk(folder / "small", free_bytes=4 * 4096) as mounted:
        ck = folder / "small" / "ck"
        r = _cli(*base, "--steps", "5000", "--checkpoint-every", "100",
                 "--checkpoint-dir", str(ck), "--save-state", str(out),
                 preexec_fn=None if mounted else limit)  # fmt: skip
        assert r.returncode == 1 and "Traceback" not in r.stderr, (
            f"exit {r.returncode}, expected 1: {r.stderr[-1500:]}"
        )
        assert "save again" not in r.stderr, f"advice the ended run cannot take: {r.stderr[-800:]}"
        kept = sorted(ck.glob("step-*.safetensors"))
        for p in kept:
            read_checkpoint(p)  # each whole (raises if torn)
        if not mounted:
            assert not out.exists() and "nothing of the state at step" in r.stderr, (
                f"the run did not say that nothing was saved: {r.stderr[-800:]}"
            )
            return
        assert kept, f"no checkpoint fitted the small disk: {r.stderr[-800:]}"
        assert out.exists(), f"--save-state on the other disk was not written: {r.stderr[-800:]}"
        step = read_checkpoint(out)[1].step
        assert step > int(kept[-1].name[5:13]), f"--save-state holds step {step}, not the last"
        assert f"the state at step {step} is in --save-state {out}" in r.stderr, (
            f"the run does not say where its state is: {r.stderr[-800:]}"
        )


def steps_per_call_that_cannot_fit(folder: Path) -> None:
    """Item 5: --steps-per-call 100000000 on a tiny bundle is refused before anything is
    loaded (exit 2, naming the memory), not 160 s of stacking and a MemoryError."""
    base = _base(folder)

    def limit() -> None:  # a run that stacks anyway fails sooner, and spares the machine
        resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))

    r = _cli(*base, "--steps", "100000000", "--steps-per-call", "100000000", preexec_fn=limit)
    _refused(r, 2, "--steps-per-call 100000000", "memory", "--steps-per-call 32")
    assert "loaded" not in r.stderr, f"the bundle was loaded first: {r.stderr[-800:]}"
    ok = _cli(*base, "--steps", "8", "--steps-per-call", "4", preexec_fn=limit)
    assert ok.returncode == 0, f"a K that fits was refused: {ok.stderr[-800:]}"


def _hostile_server(**kw: object) -> Any:
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from remote_helpers import HostileServer

    return HostileServer(**kw)  # type: ignore[arg-type]


def dripping_headers(folder: Path) -> None:
    """Item 4: a server that sends its response headers a byte at a time (every 0.2 s)
    is cut off once STEPBUNDLE_RESPONSE_TIMEOUT_S (2 s here) has passed without the
    response: exit 1 with a typed message, not a pull that runs for ever (each byte
    restarted the 60 s read limit, and nothing bounded the time to the first body byte)."""
    env = {**os.environ, "STEPBUNDLE_CACHE_DIR": str(folder / "cache"), "TMPDIR": str(folder)}
    env["STEPBUNDLE_RESPONSE_TIMEOUT_S"] = "2"
    with _hostile_server(interval=0.2) as s:
        url = f"{s.url}/drip/b"
        r = _cli("pull", url, env=env)
    _refused(r, 1, url, "STEPBUNDLE_RESPONSE_TIMEOUT_S")


def redirect_to_a_file_url(folder: Path) -> None:
    """Item 7: a 302 to file:// is refused as a redirect to a scheme that is not
    followed, not as "no bundle at ... (not found)"."""
    env = {**os.environ, "STEPBUNDLE_CACHE_DIR": str(folder / "cache"), "TMPDIR": str(folder)}
    with _hostile_server() as s:
        url = f"{s.url}/to-file/b"
        r = _cli("pull", url, env=env)
    line = _refused(r, 1, url, "redirect", "file://")
    assert "not found" not in line, f"a redirect reported as not found: {line!r}"


def shard_that_is_not_a_file(folder: Path) -> None:
    """Item 8: a dataset shard that is a folder or a named pipe is refused saying what it
    is (never opened: a pipe would block), not reported as missing."""
    import numpy as np

    from stepbundle.runtime.data.dataset_writer import write_dataset

    base = _base(folder)
    for kind, make in (("a folder", os.mkdir), ("a named pipe", os.mkfifo)):
        ds = folder / kind.split()[-1]
        rng = np.random.default_rng(0)
        rows = {"x": rng.standard_normal((16, 5), dtype=np.float32)}
        rows["y"] = rng.standard_normal((16, 3), dtype=np.float32)
        write_dataset(str(ds), rows, rows_per_shard=8)
        shard = ds / "x-00001.npy"
        shard.unlink()
        make(shard)
        r = _cli(*base[:3], str(ds), *base[4:], "--steps", "1")
        line = _refused(r, 2, "x-00001.npy", kind)
        assert "missing" not in line, f"{kind} reported as missing: {line!r}"


def attacks() -> list[tuple[str, Callable[[Path], None]]]:
    """Each attack of issue #43, by name."""
    return [
        ("1: the run lock cannot be taken", lock_that_cannot_be_taken),
        ("9: a checkpoint named for a step it does not hold", checkpoint_named_for_another_step),
        ("2, 3: Ctrl-C while loading, compiling, probing K", ctrl_c_while_loading),
        ("11: SIGTERM with --log-every 16 on a slow step", sigterm_with_sparse_logging),
        ("6: a full disk under a periodic checkpoint", full_disk_under_a_periodic_checkpoint),
        ("5: --steps-per-call 100000000", steps_per_call_that_cannot_fit),
        ("4: a server that drips its response headers", dripping_headers),
        ("7: a 302 redirect to file://", redirect_to_a_file_url),
        ("8: a dataset shard that is a folder or a named pipe", shard_that_is_not_a_file),
    ]
