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

from .errors import BundleError, UsageError

__all__ = [
    "SEED_RULES",
    "TORCH_XLA_MARK_STEP",
    "UnknownSeedRuleError",
    "advance_seed",
    "draw_affine",
    "draw_seed",
]

TORCH_XLA_MARK_STEP = "torch_xla.mark_step"
"""torch_xla's rule: ``next = (1012031 + seed * 7012063) mod 2**64``."""

SEED_RULES: frozenset[str] = frozenset({TORCH_XLA_MARK_STEP})
"""Every rule this release can apply."""

_U64 = 2**64
_MARK_STEP_MUL = 7012063
_MARK_STEP_ADD = 1012031
# torch_xla's seed for each random op within a step: x -> 2531011 + 214013 * x (mod 2**64),
# which also advances the host's running seed (``xm.get_rng_state()``).
_DRAW_MUL = 214013
_DRAW_ADD = 2531011


def _power(mul: int, add: int, n: int) -> tuple[int, int]:
    """The affine map ``x -> add + mul * x`` (mod 2**64) applied ``n`` times, as (mul, add)."""
    # Powers of one map commute, so composing by squaring costs O(log n).
    rm, ra = 1, 0
    while n:
        if n & 1:
            rm, ra = rm * mul % _U64, (add + mul * ra) % _U64
        mul, add = mul * mul % _U64, (add + mul * add) % _U64
        n >>= 1
    return rm, ra


def draw_affine(draws: int) -> tuple[int, int]:
    """``(mul, add)`` with ``draw_seed(seed, draws) == (add + mul * seed) mod 2**64``."""
    if draws < 0:
        raise UsageError(f"The number of draws must be 0 or more, got {draws}.")
    return _power(_DRAW_MUL, _DRAW_ADD, draws)


def draw_seed(seed: int, draws: int) -> int:
    """torch_xla's RNG state (``xm.get_rng_state()``) after ``draws`` random ops from ``seed``.

    Raises:
      ValueError: ``seed`` or ``draws`` is out of range.
    """
    if not 0 <= seed < _U64:
        raise UsageError(f"The seed must be an integer in [0, 2**64), got {seed}.")
    mul, add = draw_affine(draws)
    return (add + mul * seed) % _U64


class UnknownSeedRuleError(BundleError):
    """A seed rule this release does not know was asked for."""

    def __init__(self, rule: str) -> None:
        known = ", ".join(repr(r) for r in sorted(SEED_RULES))
        super().__init__(
            f"The seed rule {rule!r} is unknown to this stepbundle release, which knows "
            f"{known}. Upgrade stepbundle, or re-export the bundle with a known rule."
        )
        self.rule = rule


def advance_seed(rule: str, seed: int, steps: int = 1, draws: int = 0) -> int:
    """The seed ``steps`` steps after ``seed`` under ``rule``: ``rule^steps(seed)``.

    ``seed`` is an integer in ``[0, 2**64)`` and so is the result; ``steps`` is at least 0.
    ``draws`` is ``Rng.step_after_draws``: each step then maps ``x`` to
    ``rule(draw_seed(x, draws))``.

    Raises:
      UnknownSeedRuleError: ``rule`` is not in ``SEED_RULES``.
      ValueError: ``seed``, ``steps`` or ``draws`` is out of range.
    """
    if rule != TORCH_XLA_MARK_STEP:
        raise UnknownSeedRuleError(rule)
    if not 0 <= seed < _U64:
        raise UsageError(f"The seed must be an integer in [0, 2**64), got {seed}.")
    if steps < 0:
        raise UsageError(f"A seed can only be advanced by 0 or more steps, got {steps}.")
    dm, da = draw_affine(draws)
    # One step: x -> ADD + MUL * (da + dm * x), itself affine.
    step_mul = _MARK_STEP_MUL * dm % _U64
    step_add = (_MARK_STEP_ADD + _MARK_STEP_MUL * da) % _U64
    mul, add = _power(step_mul, step_add, steps)
    return (add + mul * seed) % _U64
