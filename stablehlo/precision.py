"""Matmul and convolution precision as an explicit property of a module.

``stablehlo.dot_general`` and ``stablehlo.convolution`` (and ``dot``, ``dynamic_conv``)
carry an optional
``precision_config``: one ``#stablehlo<precision ...>`` per operand, DEFAULT, HIGH or
HIGHEST. Without it a backend picks its own speed/accuracy trade-off (on GPUs with
TF32 or TPUs, float32 matmuls may run in reduced precision); on the CPU every setting
computes the same thing. ``set_matmul_precision`` writes one setting onto every such op
of a module, in place, so that the precision a program runs at is decided by whoever
loads it rather than by the backend.

Imports: jaxlib's MLIR bindings, stepbundle.schema.version (the settings, as the manifest
spells them), stepbundle.stablehlo.artifact.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from stepbundle.schema.errors import UsageError
from stepbundle.schema.version import MATMUL_PRECISIONS

from .artifact import Module

# jaxlib's stubs do not cover the StableHLO dialect's attribute builders.
hlo: Any = _stablehlo

__all__ = ["MATMUL_PRECISIONS", "PRECISION_OPS", "set_matmul_precision"]

PRECISION_OPS: frozenset[str] = frozenset(
    {"stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution", "stablehlo.dynamic_conv"}
)
"""The ops ``set_matmul_precision`` sets ``precision_config`` on: every StableHLO op that
has one (torch_xla writes dot_general and convolution; another producer may write the
older ``dot`` or ``dynamic_conv``)."""


def set_matmul_precision(module: Module, precision: str) -> int:
    """Set ``precision_config`` on every op of ``PRECISION_OPS`` in ``module``.

    ``precision`` is one of ``MATMUL_PRECISIONS``; both operands of each op get it, an
    existing ``precision_config`` is replaced. Every function and nested region is
    rewritten in place. Returns the number of ops set.

    Raises:
      ValueError: ``precision`` is not one of ``MATMUL_PRECISIONS``.
    """
    if precision not in MATMUL_PRECISIONS:
        raise UsageError(
            f"matmul precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {precision!r}"
        )
    targets = [op for op in module._operations() if op.name in PRECISION_OPS]
    with module._ctx:
        attr = hlo.PrecisionAttr.get(precision.upper())
        config = ir.ArrayAttr.get([attr, attr])
        for op in targets:
            op.attributes["precision_config"] = config
    return len(targets)
