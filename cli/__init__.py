"""The ``stepbundle`` command line (installed as ``stepbundle.cli``).

The top layer: it may import the schema, the runtime and (for ``export`` only, lazily)
the exporter; nothing imports it.
"""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]
