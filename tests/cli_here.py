"""``stepbundle ARGS`` run in the test's own process (tests of every folder and
environment import it: tests/conftest.py puts this folder on sys.path)."""

from __future__ import annotations

from typing import Any


def cli_here(*args: str) -> Any:
    """``stepbundle ARGS`` run in this process (``stepbundle.cli.main``), its exit code and
    what it printed, as a ``subprocess.CompletedProcess``.

    For commands refused before anything is loaded: a fresh process would spend seconds
    importing jax for a refusal that takes milliseconds. What the process adds (the
    ``python -m stepbundle`` entry, ``sys.exit`` of main's code) is covered by the tests
    that run the command in a child process. An exception escaping ``main`` fails the
    test, as a traceback on stderr would.
    """
    import contextlib
    import io
    import os
    import subprocess
    import sys

    from stepbundle.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    # main sets a default or two in its process's environment, and an export puts its
    # recipe's folder on sys.path: neither is for ours
    environ, path = dict(os.environ), list(sys.path)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's refusals
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        finally:
            os.environ.clear()
            os.environ.update(environ)
            sys.path[:] = path
    return subprocess.CompletedProcess(["stepbundle", *args], code, out.getvalue(), err.getvalue())
