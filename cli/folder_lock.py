"""One live run per checkpoint folder: ``stepbundle run`` holds a lock on a file in its
``--checkpoint-dir`` for as long as it runs, and refuses a folder another run holds.

Two runs writing ``step-N.safetensors`` into one folder would mix their checkpoints, and
a later ``--resume`` would continue one run's state with the other's step count. The
lock is ``flock`` on ``.stepbundle-run.lock``: the kernel releases it when its process
ends, however it ends (SIGKILL included), so the file a killed run leaves behind never
blocks the ``--resume`` that follows; a run that ends removes the file while it still
holds the lock, and a run that locked a file no longer under that name tries again, so
two runs never hold two different files. It holds the holder's process id and host, for the
refusal. Locks are taken by process 0 of a multi-process job, the one that writes.

Once the lock is held, no run writes in the folder, so every checkpoint temp file there
(``atomic_write``'s ``.<name>.tmp-...``) was left by a killed writer and is removed. This
is done only under the lock: a run that is refused removes nothing (a process id cannot
tell a live writer across PID namespaces, and a refused run once removed the temp file
of the live run's checkpoint in flight). Without a lock, only temp files a day old go.

Limits: a folder at a URL (an object store) has no lock. A local file system that
cannot lock (some network mounts) gets a one-line warning and the run goes on, as before.
Windows has no ``fcntl``: no lock there.

Imports: the standard library; ``stepbundle.schema.atomic``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_NAME", "holding"]

LOCK_NAME = ".stepbundle-run.lock"
# Without a lock, a temp file this old is dead: a writer changes its file as it writes.
UNLOCKED_SWEEP_AGE_S = 24 * 3600.0


@contextlib.contextmanager
def holding(folder: Path, given: str) -> Iterator[None]:
    """Hold the run lock of ``folder`` (an existing folder) until the block ends.

    Raises:
      ValueError: another live process holds it.
    """
    try:
        import fcntl
    except ImportError:  # Windows
        _sweep(folder, UNLOCKED_SWEEP_AGE_S)
        yield
        return
    path = folder / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            _warn(path, e)
            _sweep(folder, UNLOCKED_SWEEP_AGE_S)
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ValueError(
                f"--checkpoint-dir {given!r} is in use by another run ({holder}), which holds "
                f"{path}; two runs in one folder would mix their checkpoints. Wait for that "
                "run to end, or give this run a folder of its own."
            ) from None
        except OSError as e:  # a file system without locks
            os.close(fd)
            _warn(path, e)
            _sweep(folder, UNLOCKED_SWEEP_AGE_S)
            yield
            return
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it as we took it: take the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        _sweep(folder, 0.0)  # held: no writer is live here
        yield
    finally:
        # Removed while still held, so a run that opens the old file finds it gone (see
        # _same_file); a killed run leaves it, unlocked, and the next run takes it.
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a run ending removes it)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _sweep(folder: Path, min_age_s: float) -> None:
    """Remove the checkpoint temp files killed writers left in ``folder``."""
    from stepbundle.schema.atomic import temp_files

    for stale in temp_files(folder, min_age_s=min_age_s):
        with contextlib.suppress(OSError):
            os.unlink(stale)
            print(f"[run] removed {stale}, left by an interrupted write", file=sys.stderr)


def _warn(path: Path, e: OSError) -> None:
    print(
        f"[run] warning: cannot lock {path} ({e.strerror or e}); make sure no other run "
        "writes into this folder",
        file=sys.stderr,
    )
