"""Host memory of writing a checkpoint: the whole state gathered first, or streamed.

One export of a GPT (vocab 2048, width 256, 4 layers, AdamW; benchmarks/models.py), loaded
on 1 device and on 4 virtual CPU devices with FSDP. For each, the peak of the host
memory Python and numpy allocate (``tracemalloc``) while a checkpoint is written:

- gathered: every buffer copied to the host with ``_compat.to_host`` (jax's conversion,
  which also keeps its copy on the device array), then ``write_checkpoint``: what
  ``save_checkpoint`` did before #41 item 3;
- streamed: ``save_checkpoint`` now (one process): each tensor copied from the devices
  when its turn comes, for the digest and again for its bytes, and dropped.

Both files are compared byte for byte. On a CPU the device buffers are host memory too;
``tracemalloc`` counts only what the write itself allocates.

Usage: .venv/bin/python benchmarks/checkpoint_memory.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import tracemalloc
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 4)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import Case, GPTConfig, make_batches, recipe  # noqa: E402

from stepbundle.runtime import LoadOptions, _compat  # noqa: E402
from stepbundle.runtime.state.checkpoint import write_checkpoint  # noqa: E402
from stepbundle.runtime.state.named import named_values  # noqa: E402


def _peak(fn) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        fn()
        return int(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "checkpoint_memory.md")
    )
    args = ap.parse_args()

    import torch_xla

    torch_xla.device()
    from stepbundle.exporter import export
    from stepbundle.runtime import load

    cfg = GPTConfig(vocab=2048, block=32, layers=4, width=256, batch=16)
    case = Case("gpt", 4, cfg)
    batches = make_batches(case, 2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt.stepbundle"
        export(recipe(case, batches[0]), path)
        for label, kw in (("1 device", {}), ("4 devices, fsdp", {"devices": 4, "layout": "fsdp"})):
            t = load(path, options=LoadOptions.from_keywords(cache_dir=False, **kw))
            t.run(batches, 2)
            rows.append((label, *_measure(t, Path(tmp))))
            print(rows[-1], flush=True)
    mib = 2**20
    lines = [
        f"GPT (vocab {cfg.vocab}, width {cfg.width}, {cfg.layers} layers, tied embedding), "
        f"AdamW, after 2 steps; jax {jax.__version__}, virtual CPU devices "
        "(benchmarks/checkpoint_memory.py). Peak host memory allocated while one checkpoint "
        "is written (tracemalloc).",
        "",
        "| run | state | largest tensor | gathered, then written | streamed | same file |",
        "|---|---|---|---|---|---|",
    ]
    for label, total, largest, g, s, same in rows:
        lines.append(
            f"| {label} | {total / mib:.2f} MiB | {largest / mib:.2f} MiB | {g / mib:.2f} MiB "
            f"| {s / mib:.2f} MiB | {'yes' if same else 'NO'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


def _measure(t, tmp: Path) -> tuple[int, int, int, int, bool]:  # type: ignore[no-untyped-def]
    """State bytes, largest tensor, the two peaks, and whether the files are the same."""
    state = t.state_dict()
    total = sum(v.nbytes for v in state.values())
    largest = max(v.nbytes for v in state.values())
    del state
    store = t._store
    meta = _meta(t)
    gathered_file = tmp / "gathered.safetensors"
    streamed_file = tmp / "streamed.safetensors"

    def gathered() -> None:
        hosts = (_compat.to_host(b) for b in store.buffers)
        values = named_values(store.layout, hosts)
        for e in t.manifest.state:  # tied weights under each name
            for alias in e.aliases:
                values[alias] = values[e.name]
        write_checkpoint(gathered_file, values, meta)

    peak_gathered = _peak(gathered)
    peak_streamed = _peak(lambda: t.save_checkpoint(streamed_file))
    same = gathered_file.read_bytes() == streamed_file.read_bytes()
    return total, largest, peak_gathered, peak_streamed, same


def _meta(t):  # type: ignore[no-untyped-def]
    """The metadata ``save_checkpoint`` writes, for the gathered write to match it."""
    from stepbundle.runtime.state.checkpoint import CHECKPOINT_FORMAT, CheckpointMeta

    return CheckpointMeta(
        format=CHECKPOINT_FORMAT,
        step=t.step_count,
        seed=t._checkpoints._progress.seed,
        hyperparameters=dict(t._checkpoints._hp.values),
        bundle_digest=t._checkpoints._digest,
        schedules=dict(t._checkpoints._hp.specs),
        data=t._checkpoints._progress.data_position,
    )


if __name__ == "__main__":
    sys.exit(main())
