"""Parallel layouts on virtual CPU devices: what each device holds, what XLA plans, agreement.

One export of a GPT (vocab 512, width 128, 4 layers, batch 16, AdamW; benchmarks/models.py,
tied embedding), then the same bundle loaded on 1 device and on 4 and 8 devices in each
layout (dp, zero1, fsdp, fsdp+tp with 2 devices on the model axis). For each:

- state bytes resident on the fullest device (``trainer.state_bytes_per_device()``);
- XLA's memory analysis of the compiled train program (per device: its arguments, its
  temporaries, ``get_compiled_memory_stats``, what ``jax``'s ``compiled.memory_analysis()``
  returns);
- the collectives the SPMD partitioner inserted (counted in the optimized HLO);
- the largest relative difference of the losses, and the largest normwise relative
  difference of any final state tensor, from the one-device run after 5 steps.

The GPT's own module names (qkv, proj, fc, out, wte) are not nanoGPT's, so tensor
parallelism is asked for by rules written here: a readable example of ``tp_rules``.
Step times are left out: the virtual devices share this machine's cores with other jobs.

Usage: .venv/bin/python benchmarks/parallel_layouts.py [--steps 5]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import Case, GPTConfig, make_batches, recipe  # noqa: E402

from stepbundle.runtime import LoadOptions, ShardRule  # noqa: E402

# Megatron's split in this model's names: column (dim 0) into attention and the MLP,
# row (dim 1) back out, the (tied) embedding on its vocabulary.
RULES = (
    ShardRule("qkv.weight", 0),
    ShardRule("qkv.bias", 0),
    ShardRule("fc.weight", 0),
    ShardRule("fc.bias", 0),
    ShardRule("proj.weight", 1),
    ShardRule("out.weight", 1),
    ShardRule("wte.weight", 0),
)
LAYOUTS = ("dp", "zero1", "fsdp", "fsdp+tp")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _collectives(hlo: str) -> str:
    counts = {c: len(re.findall(rf"= \S+ {c}(?:-start)?\(", hlo)) for c in COLLECTIVES}
    return ", ".join(f"{n} {c}" for c, n in counts.items() if n) or "none"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "parallel_layouts.md"))
    args = ap.parse_args()

    import torch_xla

    torch_xla.device()
    from stepbundle.exporter import export
    from stepbundle.runtime import load

    case = Case("gpt", 4, GPTConfig(vocab=512, block=32, layers=4, width=128, batch=16))
    batches = make_batches(case, 4)
    runs: list[tuple[str, int, str]] = [("1 device", 1, "dp")]
    runs += [(f"{n} devices, {lay}", n, lay) for n in (4, 8) for lay in LAYOUTS]
    rows = []
    ref_losses: np.ndarray | None = None
    ref_state: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt.stepbundle"
        export(recipe(case, batches[0]), path)
        for label, n, layout in runs:
            opts = LoadOptions.from_keywords(
                cache_dir=False,
                devices=n,
                layout=layout,
                tp_rules=RULES if "tp" in layout else None,
            )
            t = load(path, options=opts)
            losses = np.array([float(m["loss"]) for m in t.run(batches, args.steps)])
            state = t.state_dict()
            plan, _ = t._dispatcher.pick("train", batches[0])
            stats = plan.executable.get_compiled_memory_stats()
            hlo = plan.executable.hlo_modules()[0].to_string()
            if ref_losses is None:
                ref_losses, ref_state = losses, state
            d_loss = float(np.max(np.abs(losses - ref_losses)) / np.max(np.abs(ref_losses)))
            d_state = max(
                float(
                    np.linalg.norm(state[k].astype(np.float64) - v)
                    / max(float(np.linalg.norm(v.astype(np.float64))), 1e-6)
                )
                for k, v in ref_state.items()
            )
            rows.append(
                (
                    label,
                    t.load_info.mesh,
                    t.load_info.state_bytes_per_device,
                    stats.argument_size_in_bytes,
                    stats.temp_size_in_bytes,
                    _collectives(hlo),
                    d_loss,
                    d_state,
                )
            )
            print(rows[-1], flush=True)
    base = rows[0][2]
    lines = [
        f"GPT (vocab 512, width 128, 4 layers, batch 16, tied embedding), AdamW, "
        f"{args.steps} steps; jax {jax.__version__}, virtual CPU devices "
        "(benchmarks/parallel_layouts.py). Bytes are per device: the state the trainer "
        "holds on the fullest device, and XLA's memory analysis of the compiled train "
        "program (arguments: state + batch + constants; temporaries).",
        "",
        "| run | mesh | state per device | vs 1 device | XLA arguments | XLA temporaries "
        "| collectives in the train program | losses vs 1 device | state vs 1 device "
        "(normwise, worst tensor) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, mesh, nbytes, arg, temp, coll, d_loss, d_state in rows:
        mesh_text = " x ".join(f"{a} {s}" for a, s in mesh.items())
        lines.append(
            f"| {label} | {mesh_text} | {nbytes / 2**20:.3f} MiB | {nbytes / base:.3f}x "
            f"| {arg / 2**20:.3f} MiB | {temp / 2**20:.3f} MiB | {coll} | {d_loss:.1e} "
            f"| {d_state:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
