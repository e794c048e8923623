"""The per-step seed rules a manifest's ``Rng.rule`` may name, and the one function to apply them.

A bundle's programs read their random seed as an input; the runtime feeds step ``k`` the
seed ``rule^k(Rng.seed)``. The rule is part of the format: the exporter names it, the
runtime applies it through ``advance_seed``, and nobody restates its formula.

``torch_xla.mark_step``: ``next = (1012031 + seed * 7012063) mod 2**64``, what torch_xla's
C++ does at every step boundary in uint64 arithmetic. (Its dynamo bridge writes the
modulus as 2**64 - 1 in Python; the two differ only for seeds that wrap, and
``tests/exporter/test_seed_rule.py`` checks against torch_xla itself that 2**64 is what
a training step sees.)

Imports: standard library only (and this package's ``errors``).
"""

from __future__ import annotations

from .errors import BundleError

__all__ = ["SEED_RULES", "TORCH_XLA_MARK_STEP", "UnknownSeedRuleError", "advance_seed"]

TORCH_XLA_MARK_STEP = "torch_xla.mark_step"
"""torch_xla's rule: ``next = (1012031 + seed * 7012063) mod 2**64``."""

SEED_RULES: frozenset[str] = frozenset({TORCH_XLA_MARK_STEP})
"""Every rule this release can apply."""

_U64 = 2**64
_MARK_STEP_MUL = 7012063
_MARK_STEP_ADD = 1012031


class UnknownSeedRuleError(BundleError):
    """A seed rule this release does not know was asked for."""

    def __init__(self, rule: str) -> None:
        known = ", ".join(repr(r) for r in sorted(SEED_RULES))
        super().__init__(
            f"The seed rule {rule!r} is unknown to this stepbundle release, which knows "
            f"{known}. Upgrade stepbundle, or re-export the bundle with a known rule."
        )
        self.rule = rule


def advance_seed(rule: str, seed: int, steps: int = 1) -> int:
    """The seed ``steps`` steps after ``seed`` under ``rule``: ``rule^steps(seed)``.

    ``seed`` is an integer in ``[0, 2**64)`` and so is the result; ``steps`` is at least 0.

    Raises:
      UnknownSeedRuleError: ``rule`` is not in ``SEED_RULES``.
      ValueError: ``seed`` or ``steps`` is out of range.
    """
    if rule != TORCH_XLA_MARK_STEP:
        raise UnknownSeedRuleError(rule)
    if not 0 <= seed < _U64:
        raise ValueError(f"The seed must be an integer in [0, 2**64), got {seed}.")
    if steps < 0:
        raise ValueError(f"A seed can only be advanced by 0 or more steps, got {steps}.")
    # One step is the affine map x -> add + mul * x (mod 2**64); powers of it are affine
    # too, so ``steps`` steps cost O(log steps) by squaring (a resumed run may skip
    # millions). All powers of one map commute, so the order of composition is free.
    mul, add = 1, 0
    step_mul, step_add = _MARK_STEP_MUL, _MARK_STEP_ADD
    while steps:
        if steps & 1:
            mul, add = mul * step_mul % _U64, (step_add + step_mul * add) % _U64
        step_mul, step_add = step_mul * step_mul % _U64, (step_add + step_mul * step_add) % _U64
        steps >>= 1
    return (add + mul * seed) % _U64
