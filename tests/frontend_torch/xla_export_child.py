"""Export recipes with the torch_xla front-end, in the torch_xla environment (.venv).

Usage: python xla_export_child.py OUT_DIR MODULE:FUNCTION...

Writes OUT_DIR/FUNCTION.stepbundle for each recipe. The torch front-end's tests run this
to compare the two front-ends' bundles of one recipe.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent, HERE.parent / "equivalence", HERE.parents[1] / "examples"):
    sys.path.insert(0, str(p))


def main() -> None:
    from stepbundle.exporter import export
    from stepbundle.exporter.workspace import xla_device

    xla_device()  # before any CPU autograd (torch_xla asserts in autograd's engine otherwise)
    out = Path(sys.argv[1])
    for spec in sys.argv[2:]:
        module, _, func = spec.partition(":")
        recipe = getattr(importlib.import_module(module), func)()
        export(recipe, out / f"{func}.stepbundle")


if __name__ == "__main__":
    main()
