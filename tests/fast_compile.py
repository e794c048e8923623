"""The tests' fast-compile XLA flag (tests/conftest.py sets it for every pytest session),
and ``XLA_FLAGS`` without it, for the children that must compile at the product's
defaults. Kept out of conftest.py so test files can import it (a conftest imported by a
test file would run its module-level set-up a second time)."""

from __future__ import annotations

# XLA's LLVM back-end at -O0: XLA's own HLO passes all still run.
FAST_COMPILE = ("--xla_backend_optimization_level=0",)


def without_fast_compile(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) without FAST_COMPILE's flags."""
    return " ".join(f for f in flags.split() if f not in FAST_COMPILE)
