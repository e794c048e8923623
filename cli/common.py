"""What every ``stepbundle`` subcommand shares: how an error is reported.

Imports: the standard library only.
"""

from __future__ import annotations

import sys

__all__ = ["EXIT_PIPE_CLOSED", "die", "is_remote"]

# stdout's reader went away (128 + SIGPIPE, as the shell reports it).
EXIT_PIPE_CLOSED = 141


def die(msg: str, code: int = 2) -> int:
    """Print ``stepbundle: error: MSG`` on stderr and return the exit code to use."""
    print(f"stepbundle: error: {msg}", file=sys.stderr)
    return code


def is_remote(bundle: str) -> bool:
    """Whether a bundle argument is a URL or ``sha256:<digest>`` (found through the
    runtime's bundle store) rather than a local path."""
    return "://" in bundle or bundle.startswith("sha256:")
