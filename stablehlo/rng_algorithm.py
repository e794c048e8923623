"""One random-bit algorithm on every backend: ``rng_bit_generator``'s DEFAULT pinned.

torch_xla writes its random numbers (dropout masks, ``torch.rand`` inside a step) as
``stablehlo.rng_bit_generator`` with ``algorithm = DEFAULT``, which leaves the choice to
each backend: XLA:CPU (and GPU) expand DEFAULT as Philox, a TPU runs an algorithm of its
own. Measured with jax 0.10.2 (``benchmarks/device/rng_check.py``, results under
``benchmarks/results/device/tpu-v5e/rng.json``): from the same u64[2] state, the CPU's
DEFAULT and PHILOX draw identical bits, the TPU's DEFAULT draws other bits, and the TPU's
PHILOX draws the CPU's bits. So a bundle's dropout masks depended on the device.

``pin_rng_algorithm`` rewrites DEFAULT to PHILOX on every such op whose state Philox
accepts (u64[2] or u64[3], the shapes XLA allows for it; torch_xla's is u64[2]). On the
CPU that is the algorithm DEFAULT already was, so the bits are unchanged there (tested:
``tests/runtime/test_rng_algorithm.py``); on a TPU the masks become the CPU's. An op
that names THREE_FRY or PHILOX already is left alone.

Imports: jaxlib's MLIR bindings, stepbundle.stablehlo.artifact.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from .artifact import Module

hlo: Any = _stablehlo  # jaxlib's stubs do not cover the dialect's attribute builders

__all__ = ["PINNED_ALGORITHM", "pin_rng_algorithm"]

PINNED_ALGORITHM = "PHILOX"
"""What DEFAULT becomes: the CPU's own expansion of DEFAULT, so CPU results keep their bits."""


def _philox_state(op: Any) -> bool:
    t = ir.RankedTensorType(op.operands[0].type)
    return t.rank == 1 and t.shape[0] in (2, 3) and str(t.element_type) in ("ui64", "i64", "si64")


def pin_rng_algorithm(module: Module) -> int:
    """Rewrite every ``rng_bit_generator`` of ``module`` whose algorithm is DEFAULT to
    ``PINNED_ALGORITHM``, in place, where its state shape allows it. Returns the number of
    ops rewritten."""
    n = 0
    with module._ctx:
        pinned = hlo.RngAlgorithmAttr.get(PINNED_ALGORITHM)
        for op in module._operations():
            if op.name != "stablehlo.rng_bit_generator":
                continue
            current = str(op.attributes["rng_algorithm"])
            if "DEFAULT" not in current or not _philox_state(op):
                continue
            op.attributes["rng_algorithm"] = pinned
            n += 1
    return n
