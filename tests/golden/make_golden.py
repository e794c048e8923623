"""Make the golden bundles of the current format version, once (needs the export env).

Golden files live in one folder per format version, tests/golden/v<major>.<minor>, and
are never regenerated: the runtime tests load every folder, so old versions' bundles stay
readable. This script writes the folder of the current ``FORMAT_VERSION`` and refuses to
run when that folder exists already (a version's golden files are made once, when the
version is made; to change them, make a new version).

For each golden recipe: export it to NAME.stepbundle, make its input batches
(NAME.inputs.npz, one (S, *shape) array per batch input, plus the eval batch when the
bundle has an eval entry), train it eagerly with torch_xla from the same state on the
same batches, and store the per-step metrics and the final state in
NAME.expected.npz. No pickle: plain .npz arrays only. Everything is written to a
temporary folder first and renamed into place at the end, so a failed run leaves nothing.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "runtime")]
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch_xla  # noqa: E402

torch_xla.device()

import numpy as np  # noqa: E402
from golden_recipes import GOLDEN, RUNS  # noqa: E402
from runtime_helpers import golden_folder_name  # noqa: E402
from support import make_batches, save_batches, to_numpy, train_eager_xla  # noqa: E402

from stepbundle.exporter import export  # noqa: E402
from stepbundle.runtime.train.schedule import parse_schedule  # noqa: E402
from stepbundle.schema import open_bundle  # noqa: E402
from stepbundle.schema.version import FORMAT_VERSION  # noqa: E402


def main() -> int:
    if sys.argv[1:]:
        print(f"usage: python {Path(__file__).name} (no arguments)", file=sys.stderr)
        return 2
    target = HERE / golden_folder_name(FORMAT_VERSION)
    if target.exists():
        print(
            f"Refused: {target} exists. Golden files are made once per format version and "
            "never regenerated. If the format changed, bump FORMAT_VERSION in "
            "schema/version.py first; this script then writes the new version's folder.",
            file=sys.stderr,
        )
        return 1
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=HERE))
    try:
        make_all(work)
        work.rename(target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    print(f"wrote {target}; commit it, and never regenerate it")
    return 0


def make_all(out: Path) -> None:
    """Export every golden recipe into ``out`` with its inputs and expected outputs."""
    for name, fn in GOLDEN.items():
        run = RUNS[name]
        recipe = fn()
        export(recipe, out / f"{name}.stepbundle")
        batches = make_batches(recipe, 3, seed=7)
        save_batches(batches, out / f"{name}.inputs.npz")
        schedule = parse_schedule(run["schedule"]) if run["schedule"] else None
        ref = train_eager_xla(fn, batches, run["steps"], seed=recipe.seed, schedule=schedule)
        out_arrays = {f"metric/{k}": ref.series(k) for k in ref.metrics[0]}
        # A gradient the step throws away (zero_grad() sets it to None before use) is
        # not state of the bundle, though eager torch_xla still holds it after a step.
        with open_bundle(out / f"{name}.stepbundle") as bundle:
            held = {s.name for s in bundle.manifest.state}
        out_arrays.update(
            {f"state/{k}": v for k, v in ref.state.items() if k in held or not k.endswith(".grad")}
        )
        if recipe.eval_step is not None:
            # Expected eval outputs on the initial state, for the eval entry.
            r = fn()
            b = {k: torch_from(v) for k, v in batches[1].items()}
            r.model.eval()
            import torch

            with torch.no_grad():
                ev = recipe.eval_step(r.model, b)
            out_arrays.update({f"eval/{k}": to_numpy(v) for k, v in ev.items()})
        np.savez(out / f"{name}.expected.npz", **out_arrays)
        print(f"wrote {name}: {len(ref.metrics)} steps, {len(ref.state)} state tensors")


def torch_from(v: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(v))


if __name__ == "__main__":
    sys.exit(main())
