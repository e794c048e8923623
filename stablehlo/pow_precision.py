"""Small float32 powers to whole exponents computed exactly, where a backend's are coarse.

torch's Adam and AdamW write their bias corrections as ``1 - beta ** step``: a float32
``stablehlo.power`` of a constant just under one (0.9, 0.999) to the step count. The
subtraction from one amplifies the power's relative error by ``beta**step / (1 -
beta**step)``, about 1000/step for 0.999: one float32 ulp of the power moves the golden
linear_adamw bundle's losses by 4e-6 (computed in float64 on a CPU). On a TPU v5e
(jax 0.10.2) the float32 power of 0.9 and 0.999 to the steps 1-64, 100, 1000 and 10,000
was up to 45 and 52 ulp off, and under ``highest`` the two Adam golden bundles drifted
3.3e-5 and 4.1e-5 from the CPU in 5-6 steps (``benchmarks/device/check.py``; results under
``benchmarks/results/device/tpu-v5e/``).

``rewrite_powers`` computes each float32 power with at most ``MAX_ELEMENTS`` elements
(scalars, in practice) by binary exponentiation in float64 when the exponent is a whole
number in ``[0, 2**24)`` (every float32 step count): at most ``BITS`` squarings and
products, each rounded in float64, then one rounding to float32. That is the correctly
rounded float32 power except within about ``(y + 2 * BITS) * 2**-53`` (relative) of a tie
between two float32 values; a CPU's ``powf`` is within an ulp (XLA:CPU misrounds
0.999**873, for one). On the v5e, after the
rewrite, the golden Adam bundles were within 1.5e-7 and 5.4e-6 of the CPU. Any other
exponent keeps the backend's own power (a ``select`` between the two). The powers of a
block are computed together, on their operands concatenated, because the TPU compiler's
time grows with the number of (emulated) float64 operations: one float64 power per
operation made a CNN's and a GPT's train programs compile several times slower, batched
much less (docs/tpu.md, "Adam's powers", has the compile times).

So the runtime applies it only where exactness is asked for: on accelerators under the
"high" and "highest" matmul precisions (``runtime/compile/rewrites.py``). At the default a TPU's
bf16 matmul passes are the larger error; on a CPU ``powf`` is within an ulp already.
Larger powers are left alone: a TPU emulates float64, and only the scalar corrections
are amplified as above.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.artifact.
"""

from __future__ import annotations

import math
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from .artifact import Module
from .build import i64s, splat, verify
from .build import op as _op

hlo: Any = _stablehlo  # jaxlib's stubs do not cover the dialect's attribute builders

__all__ = ["BITS", "MAX_ELEMENTS", "rewrite_powers"]

MAX_ELEMENTS = 64
"""The most elements a float32 power may have to be rewritten."""

BITS = 24
"""Exponents below ``2**BITS`` are computed exactly: every whole float32 up to 2**24 (a
float32 step counter stops counting there)."""


def _compare(a: Any, b: Any, direction: str, kind: str, shape: list[int]) -> Any:
    return _op(
        "stablehlo.compare",
        ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(1)),
        [a, b],
        comparison_direction=hlo.ComparisonDirectionAttr.get(direction),
        compare_type=hlo.ComparisonTypeAttr.get(kind),
    )


def _exact_power(x: Any, y: Any, original: Any, shape: list[int]) -> Any:
    """``original`` where ``y`` is not a whole number in [0, 2**BITS), else x**y exactly."""
    f32, f64, i32 = ir.F32Type.get(), ir.F64Type.get(), ir.IntegerType.get_signless(32)
    t32, t64, ti = (ir.RankedTensorType.get(shape, e) for e in (f32, f64, i32))
    n = _op("stablehlo.convert", ti, [y])
    whole = _compare(_op("stablehlo.convert", t32, [n]), y, "EQ", "FLOAT", shape)
    in_range = _op(
        "stablehlo.and",
        whole.type,
        [
            _compare(y, splat(shape, f32, 0.0), "GE", "FLOAT", shape),
            _compare(y, splat(shape, f32, float(2**BITS)), "LT", "FLOAT", shape),
        ],
    )
    use = _op("stablehlo.and", whole.type, [whole, in_range])
    base = _op("stablehlo.convert", t64, [x])
    acc = splat(shape, f64, 1.0)
    one, zero = splat(shape, i32, 1), splat(shape, i32, 0)
    for k in range(BITS):
        shifted = _op("stablehlo.shift_right_logical", ti, [n, splat(shape, i32, k)])
        bit = _op("stablehlo.and", ti, [shifted, one])
        taken = _compare(bit, zero, "NE", "SIGNED", shape)
        acc = _op(
            "stablehlo.select", t64, [taken, _op("stablehlo.multiply", t64, [acc, base]), acc]
        )
        if k + 1 < BITS:
            base = _op("stablehlo.multiply", t64, [base, base])
    exact = _op("stablehlo.convert", t32, [acc])
    return _op("stablehlo.select", t32, [use, exact, original])


def _candidates(module: Module, max_elements: int) -> list[Any]:
    f32 = ir.F32Type.get()
    found = []
    for op in module._operations():
        if op.name != "stablehlo.power":
            continue
        t = ir.RankedTensorType(op.results[0].type)
        if t.element_type == f32 and t.has_static_shape and math.prod(t.shape) <= max_elements:
            found.append(op)
    return found


SIDE_EFFECTS = frozenset(
    {
        "stablehlo.custom_call",
        "stablehlo.infeed",
        "stablehlo.outfeed",
        "stablehlo.send",
        "stablehlo.recv",
        "stablehlo.after_all",
        "stablehlo.optimization_barrier",
    }
)
"""Operations never moved to make room for a batch: their order may matter."""


def _uses(op: Any) -> list[Any]:
    """What ``op`` reads: its operands, and the values its regions' operations read (a
    ``case`` branch may use a value of the enclosing block without an operand)."""
    values = list(op.operands)
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                values.extend(_uses(inner))
    return values


def _movable(op: Any) -> bool:
    if not op.name.startswith("stablehlo.") or op.name in SIDE_EFFECTS:
        return False
    return all(
        _movable(inner)
        for region in op.regions
        for block in region.blocks
        for inner in block.operations
    )


def _batch(block: Any, powers: list[Any]) -> tuple[list[Any], Any]:
    """Make room for one batched computation of ``powers`` (ops of ``block``) before the
    first of them: the operations their operands need are moved up, in order. Returns the
    powers that can share it (not those whose operands need another power, nor those
    that would move an operation with side effects: neither happens in Adam's step), and
    the first of them, where the batch goes."""
    order = {op.operation: i for i, op in enumerate(block.operations)}
    power_ops = {p.operation for p in powers}

    def slice_of(op: Any) -> set[Any]:
        """The operations of ``block`` that ``op`` needs, directly or not."""
        seen: set[Any] = set()
        stack = [v.owner for v in _uses(op)]
        while stack:
            owner = stack.pop()
            if isinstance(owner, ir.Block):
                continue  # a block argument
            # A value defined in a nested region belongs to an op of this block, or to
            # one outside it; ops outside this block precede it.
            owner = owner.operation
            if owner not in order or owner in seen:
                continue
            seen.add(owner)
            stack.extend(v.owner for v in _uses(owner))
        return seen

    needs = {p.operation: slice_of(p) for p in powers}
    batch = [p for p in powers if not (needs[p.operation] & power_ops)]
    while batch:
        first = min((p.operation for p in batch), key=order.__getitem__)
        after = {
            p.operation: {op for op in needs[p.operation] if order[op] > order[first]}
            for p in batch
        }
        keep = [p for p in batch if all(_movable(op) for op in after[p.operation])]
        if len(keep) == len(batch):
            break
        batch = keep  # the first power may have changed: recompute what moves
    if not batch:
        return [], None
    for op in sorted(set().union(*after.values()), key=order.__getitem__):
        op.move_before(first)
    return batch, first


def rewrite_powers(module: Module, max_elements: int = MAX_ELEMENTS, exact: bool = True) -> int:
    """Compute the small float32 ``stablehlo.power`` ops of ``module`` to whole exponents
    exactly (see the module docstring), in place. The powers of one block share one
    computation, on their operands concatenated: the TPU compiler's time grows with the
    number of float64 operations, and an unrolled exponentiation per power (22 in
    examples/cifar_cnn.py's step) cost it 8 s. A power that cannot join its block's
    batch (its operands need another power, or an op with side effects would have to
    move) keeps the backend's power. ``exact=False`` only batches them: one backend
    power on the concatenated operands. Returns the number of ops rewritten.

    Raises:
      ValueError: the module does not verify after the rewrite (it may then be partly
        rewritten: ``runtime/compile/rewrites.py`` rewrites a copy).
    """
    done = 0
    with module._ctx:
        f32 = ir.F32Type.get()
        by_block: dict[Any, list[Any]] = {}
        for op in _candidates(module, max_elements):
            by_block.setdefault(op.operation.block, []).append(op)
        for block, powers in by_block.items():
            batch, first = _batch(block, powers)
            if not batch:
                continue
            sizes = [math.prod(ir.RankedTensorType(p.results[0].type).shape) for p in batch]
            total = sum(sizes)
            with ir.InsertionPoint(first), first.location:
                flat_t = ir.RankedTensorType.get([total], f32)
                flat = []
                for k in (0, 1):
                    parts = [
                        _op("stablehlo.reshape", ir.RankedTensorType.get([n], f32), [p.operands[k]])
                        for p, n in zip(batch, sizes)
                    ]
                    flat.append(
                        parts[0]
                        if len(parts) == 1
                        else _op(
                            "stablehlo.concatenate",
                            flat_t,
                            parts,
                            dimension=ir.IntegerAttr.get(ir.IntegerType.get_signless(64), 0),
                        )
                    )
                own = _op("stablehlo.power", flat_t, flat)  # the fallback: the backend's power
                result = _exact_power(flat[0], flat[1], own, [total]) if exact else own
                at = 0
                for p, n in zip(batch, sizes):
                    piece = _op(
                        "stablehlo.slice",
                        ir.RankedTensorType.get([n], f32),
                        [result],
                        start_indices=i64s([at]),
                        limit_indices=i64s([at + n]),
                        strides=i64s([1]),
                    )
                    at += n
                    shaped = _op("stablehlo.reshape", p.results[0].type, [piece])
                    p.results[0].replace_all_uses_with(shaped)
            for p in batch:
                p.operation.erase()
            done += len(batch)
        if done:
            verify(module._module, "rewriting powers")
    return done
