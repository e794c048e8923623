"""Regenerate the golden bundles and their expected outputs (needs the export env).

For each golden recipe: export it to NAME.stepbundle, make its input batches
(NAME.inputs.npz, one (S, *shape) array per batch input, plus the eval batch when the
bundle has an eval entry), train it eagerly with torch_xla from the same state on the
same batches, and store the per-step metrics and the final state in
NAME.expected.npz. No pickle: plain .npz arrays only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch_xla  # noqa: E402

torch_xla.device()

import numpy as np  # noqa: E402
from golden_recipes import GOLDEN, RUNS  # noqa: E402
from support import make_batches, save_batches, to_numpy, train_eager_xla  # noqa: E402

from stepbundle.exporter import export  # noqa: E402
from stepbundle.runtime.schedule import parse_schedule  # noqa: E402


def main() -> None:
    # --expected-only recomputes the inputs and expected outputs beside the committed
    # bundles without exporting them again (the bundles pin the format).
    expected_only = "--expected-only" in sys.argv[1:]
    for name, fn in GOLDEN.items():
        run = RUNS[name]
        recipe = fn()
        if not expected_only:
            export(recipe, HERE / f"{name}.stepbundle")
        batches = make_batches(recipe, 3, seed=7)
        save_batches(batches, HERE / f"{name}.inputs.npz")
        schedule = parse_schedule(run["schedule"]) if run["schedule"] else None
        ref = train_eager_xla(fn, batches, run["steps"], seed=recipe.seed, schedule=schedule)
        out = {f"metric/{k}": ref.series(k) for k in ref.metrics[0]}
        out.update({f"state/{k}": v for k, v in ref.state.items()})
        if recipe.eval_step is not None:
            # Expected eval outputs on the initial state, for the eval entry.
            r = fn()
            b = {k: torch_from(v) for k, v in batches[1].items()}
            r.model.eval()
            import torch

            with torch.no_grad():
                ev = recipe.eval_step(r.model, b)
            out.update({f"eval/{k}": to_numpy(v) for k, v in ev.items()})
        np.savez(HERE / f"{name}.expected.npz", **out)
        print(f"wrote {name}: {len(ref.metrics)} steps, {len(ref.state)} state tensors")


def torch_from(v: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(v))


if __name__ == "__main__":
    main()
