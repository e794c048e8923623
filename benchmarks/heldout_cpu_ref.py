"""A held-out case against PyTorch itself on the CPU, float32 and float64.

For cases torch_xla eager cannot run (frozen BatchNorm: torch_xla cannot differentiate
eval-mode BatchNorm, "the size of offset factor is 0") and to tell which side of a
bundle/torch_xla gap is right. The dropout-free variant of the case is exported, run by the
bundle for heldout.STEPS steps, and trained by PyTorch in float32 and float64 on the same
batches. Prints one ``RESULT {json}`` line:

    PYTHONPATH=/tmp/heldout-site .venv/bin/python benchmarks/heldout_cpu_ref.py "frozen BatchNorm"
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]


def main(name: str) -> None:
    import heldout as h
    from heldout_cases import CASES
    from support import make_batches, train_eager_cpu

    from stepbundle.exporter import export

    make = CASES[name]
    batches = make_batches(make(False), h.STEPS)
    # Export first: torch's autograd engine must see the XLA device before any CPU backward.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "b.stepbundle"
        t = time.perf_counter()
        export(make(False), path)
        export_s = time.perf_counter() - t
        bundle = h.run_bundle(path, batches, {})
    f32 = train_eager_cpu(lambda: h.on_cpu(make(False)), batches, h.STEPS)
    f64 = train_eager_cpu(lambda: h.on_cpu(make(False)), batches, h.STEPS, float64=True)
    out: dict[str, object] = {
        "case": name,
        "export_s": export_s,
        "losses": {
            "bundle": bundle.series("loss").tolist(),
            "pytorch_f32": f32.series("loss").tolist(),
            "pytorch_f64": f64.series("loss").tolist(),
        },
    }
    pairs = {
        "bundle_vs_f32": (bundle, f32),
        "bundle_vs_f64": (bundle, f64),
        "f32_vs_f64": (f32, f64),
    }
    for key, (a, b) in pairs.items():
        c = h.compare(a, b)
        out[key] = {k: c[k] for k in ("loss", "state", "tensor", "abs", "ref_norm")}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
