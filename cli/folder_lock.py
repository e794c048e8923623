"""One live run per checkpoint folder: ``stepbundle run`` holds a lock on a file in its
``--checkpoint-dir`` for as long as it runs, and refuses a folder another run holds.

Two runs writing ``step-N.safetensors`` into one folder would mix their checkpoints, and
a later ``--resume`` would continue one run's state with the other's step count. The
lock is ``flock`` on ``.stepbundle-run.lock``: the kernel releases it when its process
ends, however it ends (SIGKILL included), so the file a killed run leaves behind never
blocks the ``--resume`` that follows; a run that ends removes the file while it still
holds the lock, and a run that locked a file no longer under that name tries again, so
two runs never hold two different files. It holds the holder's process id and host, for the
refusal. Locks are taken by process 0 of a multi-process job, the one that writes. The
lock file is opened without following links (and never truncated on open): a symbolic
link, a hard link or anything but a regular file there is refused, or the run would write
its id into the file it names.

Once the lock is held, no run writes in the folder, so every checkpoint temp file there
(``atomic_write``'s ``.<name>.tmp-...``) was left by a killed writer and is removed. This
is done only under the lock: a run that is refused removes nothing (a process id cannot
tell a live writer across PID namespaces, and a refused run once removed the temp file
of the live run's checkpoint in flight). Without a lock, only temp files a day old go.

A lock that cannot be taken refuses the run (a ``UsageError``, exit 2): a lock file
the run may not open (another user's, in a shared folder), a folder or anything else in
its place, a file system that cannot lock. These once gave a one-line warning and the
run went on without a lock, so two runs wrote the same ``step-N`` files (issue #43).

Limits: a folder at a URL (an object store) has no lock. Windows has no ``fcntl``: no
lock there.

Imports: the standard library; ``stepbundle.schema.atomic``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from stepbundle.schema.errors import UsageError

if TYPE_CHECKING:
    from .config import RunConfig

__all__ = ["LOCK_NAME", "holding", "held_by_another_run", "lock_for_run"]

LOCK_NAME = ".stepbundle-run.lock"
# Without a lock, a temp file this old is dead: a writer changes its file as it writes.
UNLOCKED_SWEEP_AGE_S = 24 * 3600.0


@contextlib.contextmanager
def holding(folder: Path, given: str) -> Iterator[None]:
    """Hold the run lock of ``folder`` (an existing folder) until the block ends.

    Raises:
      UsageError: another live process holds it; the lock file is a symbolic link,
        a hard link or not a regular file (the run would write into what it names); it
        cannot be opened (permission denied: another user's); the file system cannot
        lock; or the run's id cannot be written into it (a full disk).
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
            # Never through a link: the run writes its id into the file it opens.
            fd = os.open(
                path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666
            )
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
                raise UsageError(_not_a_lock_file(path, given, "a symbolic link")) from None
            if e.errno == errno.EISDIR:
                raise UsageError(_not_a_lock_file(path, given, "a folder")) from None
            raise UsageError(_cannot_open(path, given, e)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            what = "a hard link to another file" if stat.S_ISREG(st.st_mode) else "not a file"
            raise UsageError(_not_a_lock_file(path, given, what))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise UsageError(
                f"--checkpoint-dir {given!r} is in use by another run ({holder}), which holds "
                f"{path}; two runs in one folder would mix their checkpoints. Wait for that "
                "run to end, or give this run a folder of its own."
            ) from None
        except OSError as e:  # a file system without locks
            os.close(fd)
            raise UsageError(
                f"--checkpoint-dir {given!r}: cannot lock {str(path)!r} "
                f"({e.strerror or e}); the folder's file system does not take locks, so "
                "this run cannot tell whether another run writes there, and two runs in one "
                "folder would mix their checkpoints. Give a folder on a local disk (or a "
                "bucket URL)."
            ) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it as we took it: take the new one
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError as e:  # a full disk (was a traceback): no checkpoint fits either
            raise UsageError(
                f"--checkpoint-dir {given!r}: cannot write its run lock {str(path)!r} "
                f"({e.strerror or e}), so no checkpoint could be written there either. Free "
                "space there, or give this run another folder."
            ) from None
        _sweep(folder, 0.0)  # held: no writer is live here
        yield
    finally:
        # Removed while still held, so a run that opens the old file finds it gone (see
        # _same_file); a killed run leaves it, unlocked, and the next run takes it.
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def _not_a_lock_file(path: Path, given: str, what: str) -> str:
    return (
        f"--checkpoint-dir {given!r}: its run lock {str(path)!r} is {what}, not a lock file "
        "a run made; a run writes into its lock file, so it would overwrite what that "
        "names. Remove it (a run makes a new one) and run again."
    )


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


def _cannot_open(path: Path, given: str, e: OSError) -> str:
    why = e.strerror or str(e)
    if e.errno in (errno.EACCES, errno.EPERM):
        hint = (
            "It may be another user's run lock, in a shared folder. Give this run a folder "
            "of its own; or, if no run uses that folder, have its owner remove the lock file."
        )
    else:
        hint = "Give this run a folder where it can create and lock a file."
    return (
        f"--checkpoint-dir {given!r}: cannot open its run lock {str(path)!r} ({why}), so "
        "this run cannot tell whether another run writes into that folder, and two runs in "
        f"one folder would mix their checkpoints. {hint}"
    )


def held_by_another_run(folder: Path) -> str | None:
    """Who holds the run lock of ``folder`` (``process 12 on host``), if a live run
    does; None if none does or the lock cannot be probed. Takes nothing: the lock is
    tried shared and let go at once."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def lock_for_run(args: RunConfig, joined: bool) -> contextlib.AbstractContextManager[None]:
    """The lock on a run's local ``--checkpoint-dir``, taken by the process that writes
    the checkpoints: this one, or process 0 of a job (``joined``)."""
    from stepbundle.runtime.io.remote import local_path
    from stepbundle.runtime.placement import distributed

    given = args.checkpoint_dir
    folder = local_path(given) if given else None
    if not given or folder is None or (joined and distributed.process_id() != 0):
        return contextlib.nullcontext()
    return holding(folder, given)
