"""Which path the runtime took where it has a fast one and a fallback, and the warning.

The runtime transfers host arrays through an internal jaxlib entry point when a probe
shows it works, and dispatches through precomputed result handlers when jaxlib offers
them (both in ``_compat.py``). When either is missing it falls back to jax's public,
slower path, and a compile-cache entry that cannot be read or written falls back to
compiling. None of these fallbacks is silent: each is recorded as a ``PathChoice`` (or a
``compile_cache.CacheEvent``) in the trainer's ``load_info``, and warns once per process with a
``StepbundleFallbackWarning``.

Imports: standard library only.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

__all__ = ["PathChoice", "PathKind", "StepbundleFallbackWarning", "warn_once"]


class StepbundleFallbackWarning(UserWarning):
    """The runtime fell back to a slower path (the run goes on; ``load_info`` says why).

    Filter it with ``warnings.filterwarnings("ignore", category=StepbundleFallbackWarning)``.
    """


class PathKind(enum.Enum):
    FAST = "fast"
    FALLBACK = "fallback"


@dataclass(frozen=True)
class PathChoice:
    """Which implementation an operation uses, and why.

    Attributes:
      operation: what it is for: ``"transfer"`` (host to device copies) or
        ``"dispatch"`` (running a step's executable and collecting its results).
      kind: the fast path, or jax's public fallback.
      reason: for the fast path, what it is; for a fallback, what was missing or wrong.
    """

    operation: str
    kind: PathKind
    reason: str

    @property
    def fast(self) -> bool:
        return self.kind is PathKind.FAST


_WARNED: set[str] = set()


def warn_once(
    key: str,
    message: str,
    category: type[Warning] = StepbundleFallbackWarning,
    stacklevel: int = 3,
) -> None:
    """Warn ``message`` the first time ``key`` comes up in this process, never again."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, category, stacklevel=stacklevel)
