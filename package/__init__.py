"""stepbundle: trace a PyTorch/XLA training step once, run it anywhere PJRT runs.

Subpackages: ``stepbundle.schema`` (the format), ``stepbundle.stablehlo`` (reading and
writing StableHLO artifacts, shared by both sides), ``stepbundle.exporter`` (torch side),
``stepbundle.runtime`` (lean, no torch) and ``stepbundle.cli`` (the command). This module
holds only the package version, so any layer may import it; it imports nothing.
"""

__version__ = "0.1.0"
