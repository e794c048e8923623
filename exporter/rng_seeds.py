"""Steps that restore torch_xla's RNG state mid-step: one seed input, the rest derived.

``torch_xla.utils.checkpoint`` recomputes a segment in the backward pass and, so that
the recomputation's dropout draws the forward's masks, sets the RNG state back to what
it was when the segment's forward began (``xm.set_rng_state`` under ``xm.fork_rng``).
torch_xla then starts a new seed value in the graph, which becomes a second graph input
holding ``draw_seed(seed, K)``: the seed after the ``K`` random ops the step drew before
the segment. Leaving ``fork_rng`` sets the state once more, to what it was when the
backward pass began (``draw_seed(seed, N)``), and ``mark_step`` advances *that*: the
next step's seed is ``rule(draw_seed(seed, N))``, not ``rule(seed)``.

The exporter proves both from the values torch_xla fed its two traced steps
(``prove_seeds``), keeps one seed input, and puts a ``@main`` in front of the program
that computes each restored seed from it (``derive_seeds``); ``K`` and ``N`` go to
``Rng.restored_after_draws`` and ``Rng.step_after_draws``.

Imports: stepbundle.schema.rng, stepbundle.stablehlo.artifact, stepbundle.frontend.errors
(frontend_core/errors.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stepbundle.frontend.errors import ExportError
from stepbundle.schema.rng import TORCH_XLA_MARK_STEP, advance_seed, draw_affine, draw_seed
from stepbundle.stablehlo import artifact as mlir

__all__ = ["MAX_DRAWS", "SeedProof", "derive_seeds", "prove_seeds"]

MAX_DRAWS = 1 << 16
"""The most random ops one step may draw before a restore for the proof to find it."""

MAX_SYNCS = 4
"""The most syncs between the exporter's two traced steps the proof of ``N`` allows for."""

INNER = "stepbundle_restored_rng"
"""The name torch_xla's ``@main`` takes behind the wrapper that derives the seeds."""


@dataclass(frozen=True)
class SeedProof:
    """How a step's seed inputs relate.

    Attributes:
      base: the graph input that is the step's seed.
      derived: ``(graph input, K)`` for each other seed input, which is ``draw_seed(seed, K)``.
      step_draws: ``N`` with next step's seed ``rule(draw_seed(seed, N))``, or None when
        the two traces do not show it (one seed input whose steps follow no such ``N``).
    """

    base: int
    derived: tuple[tuple[int, int], ...]
    step_draws: int | None


def _draws_to(start: int, targets: set[int]) -> dict[int, int]:
    """For each target reached from ``start`` in 0..MAX_DRAWS draws, the first count."""
    found: dict[int, int] = {}
    x = start
    for k in range(MAX_DRAWS + 1):
        if x in targets and x not in found:
            found[x] = k
            if len(found) == len(targets):
                break
        x = draw_seed(x, 1)
    return found


def _relate(values: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
    """The position of the base seed among ``values`` and each other's draw count."""
    for b, start in enumerate(values):
        # K = 0 when the segment drew first: the restored seed is the step's own.
        others = {v for i, v in enumerate(values) if i != b}
        found = _draws_to(start, others)
        if len(found) == len(others):
            return b, tuple(found[v] if i != b else 0 for i, v in enumerate(values))
    return None


def _step_draws(first: int, second: int) -> int | None:
    """``N`` with ``second == rule^j(draw_seed(first, N))`` for some ``j`` in 1..MAX_SYNCS:
    the exporter syncs between its two traced steps, and every further sync (an empty
    step) advances the seed by the plain rule once more."""
    x = first
    for n in range(MAX_DRAWS + 1):
        for j in range(1, MAX_SYNCS + 1):
            if advance_seed(TORCH_XLA_MARK_STEP, x, j) == second:
                return n
        x = draw_seed(x, 1)
    return None


def prove_seeds(
    positions: Sequence[int], first: Sequence[int], second: Sequence[int], what: str
) -> SeedProof:
    """Relate the seed inputs at graph ``positions``, read as ``first`` and ``second`` in two
    consecutive traced steps (unsigned 64-bit values).

    Raises:
      ExportError: several seed inputs that are not one seed and draws after it, or
        relate differently in the two steps, or a seed whose second step does not
        follow from the first by the step rule and up to ``MAX_DRAWS`` draws (the step
        sets the RNG state itself).
    """
    ra, rb = _relate(first), _relate(second)
    if ra is None or rb is None or ra != rb:
        raise ExportError(
            f"The {what} reads the RNG seed {len(positions)} times (graph inputs "
            f"{', '.join(map(str, positions))}), and the values are not one seed and the "
            f"seeds after up to {MAX_DRAWS} of torch_xla's draws from it in both traced "
            "steps: something in the step sets torch_xla's RNG state to a value of its "
            "own. Only torch_xla.utils.checkpoint's restore is supported; remove the "
            "other xm.set_rng_state calls from the step."
        )
    b, ks = ra
    step = _step_draws(first[b], second[b])
    if step is None and len(positions) == 1:
        raise ExportError(
            f"The {what} reads the RNG seed, and the second traced step's seed "
            f"({second[b]}) does not follow from the first's ({first[b]}) by torch_xla's "
            "step rule: something in the step sets the RNG state itself (torch.manual_seed, "
            "xm.set_rng_state), so a bundle, which advances the seed by the rule every "
            "step, would draw other random numbers than the step does. Remove those calls "
            "from the step, and seed once before the export (Recipe(seed=...))."
        )
    if step is None:
        raise ExportError(
            f"The {what} restores torch_xla's RNG state mid-step, and the second traced "
            "step's seed is not the first's after the step rule and up to "
            f"{MAX_DRAWS} draws, so the seeds of later steps are unknown. Please report "
            "this with the recipe."
        )
    derived = tuple((positions[i], k) for i, k in enumerate(ks) if i != b)
    return SeedProof(positions[b], derived, step)


def derive_seeds(module: mlir.Module, base: int, derived: Sequence[tuple[int, int]]) -> None:
    """Wrap ``module``'s ``@main`` so that it reads the seed at input ``base`` only and
    computes each ``derived`` input ``(i, K)`` as ``draw_seed(seed, K)`` in i64 arithmetic
    (wrapping, so equal to the unsigned 64-bit rule). The new ``@main`` has the old one's
    inputs without the derived ones, in order."""
    ins, outs = module.main_types()
    gone = {i for i, _ in derived}
    args: list[str] = []
    lines: list[str] = []
    operands = [f"%a{i}" for i in range(len(ins))]
    for i, k in derived:
        mul, add = draw_affine(k)
        as_i64 = [v - (1 << 64) if v >= 1 << 63 else v for v in (mul, add)]
        t = ins[i]
        lines += [
            f'%m{i} = "stablehlo.constant"() {{value = dense<{as_i64[0]}> : {t}}} : () -> {t}',
            f'%b{i} = "stablehlo.constant"() {{value = dense<{as_i64[1]}> : {t}}} : () -> {t}',
            f'%p{i} = "stablehlo.multiply"(%a{base}, %m{i}) : ({t}, {t}) -> {t}',
            f'%d{i} = "stablehlo.add"(%p{i}, %b{i}) : ({t}, {t}) -> {t}',
        ]
        operands[i] = f"%d{i}"
    args = [f"%a{i}: {t}" for i, t in enumerate(ins) if i not in gone]
    in_types, out_types = ", ".join(ins), ", ".join(outs)
    lines.append(
        f'%r:{len(outs)} = "func.call"({", ".join(operands)}) {{callee = @{INNER}}} : '
        f"({in_types}) -> ({out_types})"
    )
    lines.append(
        f'"func.return"({", ".join(f"%r#{j}" for j in range(len(outs)))}) : ({out_types}) -> ()'
    )
    wrapper = (
        "module {\n"
        f"  func.func private @{INNER}({in_types}) -> ({out_types})\n"
        f"  func.func @main({', '.join(args)}) -> ({out_types}) {{\n"
        + "".join(f"    {line}\n" for line in lines)
        + "  }\n}\n"
    )
    try:
        module.replace_main(INNER, wrapper)
    except ValueError as e:  # pragma: no cover - a wrapper this module wrote is valid
        raise ExportError(f"Internal error: the seed wrapper is invalid ({e}).") from e
