"""stepbundle.export_torch: capture a PyTorch training step with torch alone and write a bundle.

The second front-end: the same ``Recipe`` as ``stepbundle.exporter`` (the torch_xla
front-end), the same bundle format, the same runtime, and no torch_xla. It needs current
torch (2.10 or newer) and jax; ``pip install 'stepbundle[export-torch]'``.

Imports: torch, jax, stepbundle.schema, stepbundle.stablehlo and the front-end core
(stepbundle.frontend: Recipe, errors, dtypes, the bundle writer); never torch_xla.
"""

from __future__ import annotations

from stepbundle.frontend.errors import ExportError
from stepbundle.frontend.recipe import Recipe

from .export import FRONTEND, NO_TORCH_XLA, ExportReport, export

__all__ = ["FRONTEND", "NO_TORCH_XLA", "ExportError", "ExportReport", "Recipe", "export"]
