"""stepbundle: trace a PyTorch/XLA training step once, run it anywhere PJRT runs.

Subpackages: ``stepbundle.schema`` (the format), ``stepbundle.exporter`` (torch side),
``stepbundle.runtime`` (lean, no torch). This package itself holds the CLI only and
imports none of them eagerly.
"""

__version__ = "0.1.0"
