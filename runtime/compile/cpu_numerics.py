"""How the runtime's CPU programs are compiled to be as accurate as PyTorch's CPU kernels.

Two parts, decided here once for ``program.py`` (what is compiled) and ``load.py``
(``LoadInfo.cpu_numerics``, what is said):

- long float sums in blocks (``stablehlo/blocked_sums.py``, the ``blocked-sums``
  rewrite): the order of a BatchNorm's sums over N*H*W values is part of the program,
  so it no longer depends on which kernel XLA:CPU picks (its own loops, or YNNPACK's on
  jax >= 0.8), nor on the host. ``STEPBUNDLE_CPU_BLOCKED_SUMS=0`` switches it off;
- YNNPACK's fusions off per compile (``_compat.cpu_numerics_overrides``: jaxlib >= 0.8,
  unless the user's ``XLA_FLAGS`` mention the option).

Both change the compiled program (the bytecode, the compile options), so both are in the
compile cache's key. docs/numerics.md has the measurements behind them.

Imports: the runtime's _compat.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .. import _compat

__all__ = ["BLOCKED_SUMS_ENV", "CpuNumerics", "cpu_numerics"]

BLOCKED_SUMS_ENV = "STEPBUNDLE_CPU_BLOCKED_SUMS"
"""``0`` keeps a CPU program's long sums as the program writes them (XLA:CPU then picks
their order); anything else, or unset, blocks them."""


@dataclass(frozen=True)
class CpuNumerics:
    """What a CPU program is compiled with.

    Attributes:
      overrides: the XLA options set per compile (``CompileOptions.env_option_overrides``).
      blocked_sums: whether long float sums are rewritten in blocks before compiling.
      words: both, in words (``LoadInfo.cpu_numerics``).
    """

    overrides: tuple[tuple[str, str], ...]
    blocked_sums: bool
    words: str


def cpu_numerics(environ: Mapping[str, str] | None = None) -> CpuNumerics:
    """The CPU numerics ``environ`` (default: ``os.environ``) asks for."""
    env = os.environ if environ is None else environ
    overrides, ynn = _compat.cpu_numerics_overrides(env.get("XLA_FLAGS", ""))
    blocked = env.get(BLOCKED_SUMS_ENV, "1").strip() != "0"
    sums = "long sums in blocks" if blocked else f"long sums as written ({BLOCKED_SUMS_ENV}=0)"
    return CpuNumerics(overrides, blocked, f"{sums}; {ynn}")
