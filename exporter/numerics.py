"""``Recipe(numerics=...)``: which numerics the exported programs compute.

torch_xla lowers training BatchNorm to ``stablehlo.batch_norm_training`` and
``stablehlo.batch_norm_grad``, ops every XLA release expands its own way, with the
variance as E[x^2] - E[x]^2. That cancels when a channel's mean is large against its
spread (both terms are large and nearly equal, so float32 keeps few correct digits of
their difference: inputs of mean 30 and std 1 come out ~1e-4 off, where PyTorch's kernels,
which subtract the mean first, are ~1e-6 off): on torchvision's resnet18 the
gradients come out ~1% off PyTorch float64, and a bundle's results change with the XLA
version that runs it. So by default (``"pytorch"``) the exporter rewrites both ops, after
torch_xla has lowered the step, into plain StableHLO computing what PyTorch's kernels
compute (``stablehlo/batch_norm.py``): every XLA release and backend then runs the same
stable arithmetic. ``"torch_xla"`` keeps torch_xla's ops untouched, for users who need a
bundle to equal torch_xla eager bit for bit (on the XLA release torch_xla uses).

The choice is written to the manifest (``Manifest.numerics``).

Imports: stepbundle.stablehlo, stepbundle.schema, stepbundle.frontend.errors
(frontend_core/errors.py).
"""

from __future__ import annotations

from stepbundle.frontend.errors import ExportError
from stepbundle.schema.version import NUMERICS, NUMERICS_PYTORCH, NUMERICS_TORCH_XLA
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.batch_norm import decompose_batch_norm

__all__ = ["DEFAULT_NUMERICS", "apply_numerics", "checked_numerics"]

DEFAULT_NUMERICS = NUMERICS_PYTORCH
"""What ``Recipe.numerics`` defaults to: PyTorch's formulas, the accurate ones."""


def checked_numerics(value: object) -> str:
    """``Recipe.numerics``, refused unless it is one of ``schema.version.NUMERICS``."""
    if not isinstance(value, str) or value not in NUMERICS:
        raise ExportError(
            f"Recipe.numerics is {value!r}; it must be one of {sorted(NUMERICS)}: "
            '"pytorch" (the default) computes training BatchNorm as PyTorch does, '
            '"torch_xla" keeps torch_xla\'s ops so a bundle equals torch_xla eager.'
        )
    return value


def apply_numerics(module: mlir.Module, numerics: str, what: str) -> int:
    """Rewrite ``module`` for ``numerics`` (checked already); returns the ops replaced."""
    if numerics == NUMERICS_TORCH_XLA:
        return 0
    try:
        return decompose_batch_norm(module)
    except ValueError as e:
        raise ExportError(
            f"The {what}'s BatchNorm could not be rewritten into PyTorch's numerics ({e}). "
            'Export with Recipe(numerics="torch_xla") to keep torch_xla\'s ops, and '
            "please report this with the recipe."
        ) from e
