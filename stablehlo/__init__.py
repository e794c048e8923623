"""StableHLO artifacts, shared by the exporter and the runtime.

Neutral ground between the two sides: the exporter writes artifacts and checks them
with these functions, the runtime reads, checks and re-attributes them, and neither side
imports the other. ``stepbundle.stablehlo.artifact`` is the one implementation.

Imports: jaxlib's MLIR bindings, the standard library. Never torch, never the runtime.
"""

from __future__ import annotations
