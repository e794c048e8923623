"""Write an example's batches to an .npz for ``stepbundle run --data``.

Usage: python examples/make_data.py FILE.py:FUNC OUT.npz [STEPS]
FUNC(steps) returns a dict of name -> array shaped (STEPS, *batch shape).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np


def main() -> None:
    spec, out = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    file, _, func = spec.rpartition(":")
    mod_spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    data = getattr(module, func)(steps)
    np.savez(out, **{k: np.asarray(v) for k, v in data.items()})
    print(f"wrote {out}: " + ", ".join(f"{k} {np.shape(v)}" for k, v in data.items()))


if __name__ == "__main__":
    main()
