"""What the stable BatchNorm costs: step time of the rewrite against torch_xla's ops.

Exports each model twice, with ``Recipe(numerics="pytorch")`` (the default: training
BatchNorm written out in plain StableHLO, ``stablehlo/batch_norm.py``) and with
``numerics="torch_xla"`` (torch_xla's ``batch_norm_training`` / ``batch_norm_grad``,
which XLA expands itself), then times both bundles' training steps side by side in one
process of the lean environment (newest jax, no torch: where bundles run;
``batch_norm_child.py``). Rounds alternate the order of the two bundles, so slow phases
of the machine hit both alike; each figure is the median over rounds of one block's
seconds per step, the block ending when its last loss has been read, in CPU time (every
thread of the process, what a step costs whoever else shares the machine) and wall time.
The issue's target (#16) is a ratio of at most 1.10.

Models: the equivalence suite's CNN (2 x conv-BatchNorm-ReLU-pool, then linear; batch 16
of 3x24x24 images) and torchvision's resnet18 (batch 8 of 3x64x64 images), both under
SGD with nesterov momentum.

Usage::

    .venv/bin/python benchmarks/batch_norm.py                 # writes build/batch_norm.md
    .venv/bin/python benchmarks/batch_norm.py --rounds 3 --out benchmarks/results/batch_norm.md

Imports: torch and the exporter (to build the bundles); the child imports the runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
os.environ.setdefault("PJRT_DEVICE", "CPU")


def _classify(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
    import torch

    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _recipe(model_name: str, numerics: str) -> Any:
    import torch
    from torch import nn

    from stepbundle.exporter import Recipe

    torch.manual_seed(0)
    if model_name == "cnn":
        model: nn.Module = nn.Sequential(
            nn.Conv2d(3, 8, 3, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 4 * 4, 10),
        )
        x = torch.randn(16, 3, 22, 22)
    else:
        import torchvision

        model = torchvision.models.resnet18(weights=None, num_classes=10)
        x = torch.randn(8, 3, 64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    y = torch.arange(x.shape[0]) % 10
    return Recipe(
        model=model, optimizer=opt, step=_classify, example_batch={"x": x, "y": y},
        numerics=numerics,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["cnn", "resnet18"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target-s", type=float, default=0.5, help="seconds per timed block")
    ap.add_argument("--lean-python", default=str(ROOT / ".venv-lean" / "bin" / "python"))
    ap.add_argument("--out", default=str(ROOT / "build" / "batch_norm.md"))
    args = ap.parse_args()

    import numpy as np

    from stepbundle.exporter import export

    results: dict[str, Any] = {"rounds": args.rounds, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models:
            paths = {}
            for numerics in ("pytorch", "torch_xla"):
                paths[numerics] = work / f"{name}-{numerics}.stepbundle"
                report = export(_recipe(name, numerics), paths[numerics])
                if numerics == "pytorch":
                    rewrites = report.numerics_rewrites
            batch = _recipe(name, "pytorch").example_batch
            npz = work / f"{name}-batch.npz"
            np.savez(npz, **{k: v.numpy() for k, v in batch.items()})
            proc = subprocess.run(
                [
                    args.lean_python, str(HERE / "batch_norm_child.py"),
                    str(paths["pytorch"]), str(paths["torch_xla"]), str(npz),
                    str(args.rounds), str(args.target_s),
                ],
                capture_output=True, text=True, timeout=1800, check=False,
            )  # fmt: skip
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            timing = json.loads(proc.stdout.strip().splitlines()[-1])
            timing["ops_rewritten"] = rewrites
            results["models"][name] = timing
            print(
                f"{name}: rewrite {timing['pytorch']['cpu_median_ms']:.3f} CPU ms/step, "
                f"torch_xla ops {timing['torch_xla']['cpu_median_ms']:.3f} CPU ms/step, "
                f"ratio {timing['cpu_ratio']:.3f} (wall: {timing['ratio']:.3f})",
                flush=True,
            )
        results["jax"] = timing.get("jax", "")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "# Stable BatchNorm: step time of the rewrite against torch_xla's ops",
        "",
        f"`benchmarks/batch_norm.py`, {args.rounds} rounds, CPU, runtime jax {results['jax']}. "
        "Medians over rounds of ms per training step (bundle order alternating per round), "
        "CPU time (every thread of the process; on this shared machine much less noisy than "
        "wall time) and wall time; ratio = rewrite / torch_xla's ops (target <= 1.10).",
        "",
        "| model | BatchNorm ops rewritten | rewrite, CPU ms | torch_xla ops, CPU ms "
        "| **ratio (CPU)** | rewrite, wall ms | torch_xla ops, wall ms | ratio (wall) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, t in results["models"].items():
        a, b = t["pytorch"], t["torch_xla"]
        lines.append(
            f"| {name} | {t['ops_rewritten']} | {a['cpu_median_ms']:.3f} | "
            f"{b['cpu_median_ms']:.3f} | **{t['cpu_ratio']:.3f}** | {a['median_ms']:.3f} | "
            f"{b['median_ms']:.3f} | {t['ratio']:.3f} |"
        )
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
