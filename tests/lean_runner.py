"""Run a bundle in a separate process and save what came out (used by tests).

Usage: python tests/lean_runner.py BUNDLE DATA.npz STEPS OUT.npz [--seed N]
           [--schedule SPEC [--schedule-offset K]] [--eval] [--require-no-torch]

Writes OUT.npz with ``metric/<name>`` arrays (one value per step), ``state/<name>``
arrays (final state), and ``info/torch_importable`` (0 or 1).
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.runtime.train.batches import iter_batches
from stepbundle.runtime.train.schedule import parse_schedule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("data")
    ap.add_argument("steps", type=int)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--schedule")
    # Step i uses the schedule's value at i + K (a run that starts K steps in).
    ap.add_argument("--schedule-offset", type=int, default=0)
    ap.add_argument("--require-no-torch", action="store_true")
    args = ap.parse_args()
    torch_importable = importlib.util.find_spec("torch") is not None
    if args.require_no_torch and torch_importable:
        raise SystemExit("torch is importable in this process; the lean runner must not see it")
    trainer = load(args.bundle, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    if args.seed is not None:
        trainer.seed = args.seed
    if args.schedule:
        fn = parse_schedule(args.schedule)
        offset = args.schedule_offset
        trainer.set_schedule("lr", (lambda k: fn(k + offset)) if offset else fn)
    with np.load(args.data, allow_pickle=False) as z:
        batches = iter_batches({k: z[k] for k in z.files})
    metrics = trainer.run(batches, args.steps)
    out: dict[str, np.ndarray] = {"info/torch_importable": np.array(int(torch_importable))}
    for name in metrics[0]:
        out[f"metric/{name}"] = np.stack([np.asarray(m[name]) for m in metrics])
    for name, value in trainer.state_dict().items():
        out[f"state/{name}"] = value
    np.savez(args.out, **out)


if __name__ == "__main__":
    main()
