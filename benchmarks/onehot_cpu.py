"""The one-hot sums' rewrite on the CPU: a small GPT with a large vocabulary, side by side.

    .venv/bin/python benchmarks/onehot_cpu.py export -o build/onehot_gpt.stepbundle
    .venv-lean/bin/python benchmarks/onehot_cpu.py bench build/onehot_gpt.stepbundle \\
        --out benchmarks/results/onehot_cpu.json

The model is benchmarks/models.py's SmallGPT (2 layers, width 64, context 128, batch 8,
no dropout) with a 16,384-token vocabulary, trained by cross_entropy with AdamW: the
loss's three sums over a one-hot (the loss, the count of targets, a per-token sum of the
backward; stablehlo/onehot.py) are each a pass over 1,024 x 16,384 elements, next to
an LM head of 1,024 x 64 x 16,384. ``bench`` loads the bundle twice in one process, as
the runtime loads it and with the ``onehot-sums`` rewrite left out of its pipeline, and
times both in alternating rounds (medians), after checking that their first losses agree.

Imports: numpy, stepbundle; torch and the exporter for ``export``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions

VOCAB, BLOCK, BATCH = 16384, 128, 8


def export(path: str) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import GPTConfig, SmallGPT

    from stepbundle.exporter import Recipe
    from stepbundle.exporter import export as write

    def step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
        optimizer.zero_grad()
        logits = model(batch["idx"])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), batch["target"].reshape(-1)
        )
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=VOCAB, block=BLOCK, layers=2, width=64, heads=4, dropout=0.0, batch=BATCH)
    model = SmallGPT(cfg)
    tokens = torch.randint(0, VOCAB, (BATCH, BLOCK + 1))
    recipe = Recipe(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True),
        step=step,
        example_batch={"idx": tokens[:, :-1].contiguous(), "target": tokens[:, 1:].contiguous()},
    )
    report = write(recipe, path)
    print(f"wrote {report.path} ({report.size} bytes)")


def bench(args: argparse.Namespace) -> int:
    from stepbundle.runtime import load
    from stepbundle.runtime.compile import rewrites

    rng = np.random.default_rng(0)
    batches = [
        {
            "idx": rng.integers(0, VOCAB, (BATCH, BLOCK)).astype(np.int64),
            "target": rng.integers(0, VOCAB, (BATCH, BLOCK)).astype(np.int64),
        }
        for _ in range(4)
    ]
    rewritten = load(args.bundle, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    before = rewrites.REWRITES
    rewrites.REWRITES = tuple(r for r in before if r[0] != "onehot-sums")
    try:
        kept = load(args.bundle, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    finally:
        rewrites.REWRITES = before
    first = {
        name: float(t.step(batches[0])["loss"])
        for name, t in (("rewritten", rewritten), ("kept", kept))
    }
    assert abs(first["rewritten"] - first["kept"]) <= 1e-6 * abs(first["kept"]), first

    def timed(t: Any) -> float:
        t0 = time.perf_counter()
        m = t.run(batches, args.steps)
        float(m[-1]["loss"])
        return (time.perf_counter() - t0) / args.steps * 1e3

    samples: dict[str, list[float]] = {"rewritten": [], "kept": []}
    timed(rewritten), timed(kept)
    for _ in range(args.rounds):
        samples["rewritten"].append(timed(rewritten))
        samples["kept"].append(timed(kept))
    med = {k: float(np.median(v)) for k, v in samples.items()}
    out = {
        "bundle": args.bundle,
        "model": f"SmallGPT 2 layers, width 64, vocab {VOCAB}, context {BLOCK}, batch {BATCH}, AdamW",
        "first_loss": first,
        "ms_per_step": med,
        "kept_over_rewritten": med["kept"] / med["rewritten"],
        "samples_ms": samples,
        "steps_per_round": args.steps,
    }
    for k, v in med.items():
        print(f"{k:10s} {v:8.2f} ms/step  samples {np.round(samples[k], 2).tolist()}")
    print(f"without the rewrite / with it: {out['kept_over_rewritten']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("-o", "--output", required=True)
    b = sub.add_parser("bench")
    b.add_argument("bundle")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--out", default=None)
    a = p.parse_args()
    if a.cmd == "export":
        export(a.output)
        return 0
    return bench(a)


if __name__ == "__main__":
    raise SystemExit(main())
