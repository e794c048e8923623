"""The exporter's error type.

Imports: stepbundle.schema only.
"""

from __future__ import annotations

from stepbundle.schema.errors import BundleError

__all__ = ["ExportError"]


class ExportError(BundleError):
    """The step cannot be exported faithfully; the message says why and how to fix it.

    The exporter refuses rather than write a bundle that would replay the step wrong.
    """
