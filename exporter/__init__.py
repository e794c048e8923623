"""stepbundle.exporter: trace a PyTorch training step with torch_xla and write a bundle.

The only part of stepbundle that imports torch_xla. ``Recipe``, ``ExportError`` and
``ExportReport`` are the front-end core's (``stepbundle.frontend``), re-exported here so
that ``from stepbundle.exporter import Recipe`` keeps working.
"""

from __future__ import annotations

import os

# torch_xla runs on the host CPU unless told otherwise; a user with a TPU or GPU sets
# PJRT_DEVICE themselves.
os.environ.setdefault("PJRT_DEVICE", "CPU")

from stepbundle.frontend.errors import ExportError  # noqa: E402
from stepbundle.frontend.recipe import Recipe  # noqa: E402

from .export import ExportReport, export  # noqa: E402

__all__ = ["ExportError", "ExportReport", "Recipe", "export"]
