"""Host memory of a checkpoint's write and restore: the whole state at once, or streamed.

One export of a GPT (vocab 2048, width 256, 4 layers, AdamW; benchmarks/models.py), loaded
on 1 device, on 4 virtual CPU devices with FSDP, and as a job of 2 processes x 2 CPU
devices with FSDP (jax.distributed on localhost). For each, the peak of the host memory
Python and numpy allocate (``tracemalloc``, in each process) while a checkpoint is
written, and while it is restored:

- write, gathered: every buffer copied to the host whole (``_compat.to_host``, jax's
  conversion; in a job, ``state_dict`` on every process), then ``write_checkpoint`` on
  process 0: what ``save_checkpoint`` did before #41 item 3;
- write, streamed: ``save_checkpoint`` now: each tensor copied from the devices when its
  turn comes, for the digest and again for its bytes, and dropped; in a job every
  process joins each gather in one order and only process 0 keeps what it gathers;
- restore, whole: ``read_checkpoint`` (every tensor copied out of the file), then the
  state put on the devices: what ``load_checkpoint`` did before;
- restore, streamed: ``load_checkpoint`` now: the tensors are views of the mapped file,
  each process copying its own devices' pieces to them.

Both files are compared byte for byte, and the restored state with the saved one. On a
CPU the device buffers are host memory too; ``tracemalloc`` counts only what the write
or the restore itself allocates (not the devices' buffers, nor the file's mapped pages,
which are the page cache's).

Usage: .venv/bin/python benchmarks/checkpoint_memory.py
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
MIB = 2**20


def _peak(fn) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        fn()
        return int(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint_memory.md"))
    ap.add_argument("--child", nargs=4, metavar=("PID", "PORT", "BUNDLE", "DIR"))
    args = ap.parse_args()
    if args.child:
        return _child(*args.child)

    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    import torch_xla

    torch_xla.device()
    sys.path.insert(0, str(HERE))
    from models import Case, GPTConfig, make_batches, recipe

    from stepbundle.exporter import export
    from stepbundle.runtime import LoadOptions, load

    cfg = GPTConfig(vocab=2048, block=32, layers=4, width=256, batch=16)
    case = Case("gpt", 4, cfg)
    batches = make_batches(case, 2)
    rows: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt.stepbundle"
        export(recipe(case, batches[0]), path)
        for label, kw in (("1 device", {}), ("4 devices, fsdp", {"devices": 4, "layout": "fsdp"})):
            t = load(path, options=LoadOptions.from_keywords(cache_dir=False, **kw))
            t.run(batches, 2)
            rows.append((label, _measure(t, Path(tmp) / label.replace(" ", "_"), True)))
            print(rows[-1], flush=True)
        np.savez(
            Path(tmp) / "batches.npz",
            **{f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()},
        )
        port = _free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", str(i), str(port), str(path), tmp],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in range(2)
        ]
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=900)
            if p.returncode != 0:
                raise SystemExit(f"process {i} failed:\n{out[-3000:]}")
        for i in range(2):
            got = json.loads((Path(tmp) / f"child-{i}.json").read_text())
            rows.append((f"2 processes x 2 devices, fsdp: process {i}", got))
            print(rows[-1], flush=True)
    lines = [
        f"GPT (vocab {cfg.vocab}, width {cfg.width}, {cfg.layers} layers, tied embedding), "
        f"AdamW, after 2 steps; jax {jax.__version__}, virtual CPU devices "
        "(benchmarks/checkpoint_memory.py). Peak host memory allocated while one checkpoint "
        "is written, and while it is restored (tracemalloc, in each process). 'gathered' "
        "and 'whole': the state read whole first (before #41 item 3's streaming); "
        "'streamed': `save_checkpoint` and `load_checkpoint` now. In the job, process 0 "
        "writes the file and process 1 joins the gathers.",
        "",
        "| run | state | largest tensor | write: gathered | write: streamed | same file "
        "| restore: whole | restore: streamed | same state |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows:
        lines.append(
            f"| {label} | {r['total'] / MIB:.2f} MiB | {r['largest'] / MIB:.2f} MiB "
            f"| {r['write_gathered'] / MIB:.2f} MiB | {r['write_streamed'] / MIB:.2f} MiB "
            f"| {'yes' if r['same_file'] else 'NO'} | {r['restore_whole'] / MIB:.2f} MiB "
            f"| {r['restore_streamed'] / MIB:.2f} MiB | {'yes' if r['same_state'] else 'NO'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(pid: str, port: str, bundle: str, tmp: str) -> int:
    """One process of the 2-process job: load under FSDP, 2 steps, measure, JSON out."""
    from stepbundle.runtime import LoadOptions, load
    from stepbundle.runtime.placement import distributed

    distributed.initialize(f"localhost:{port}", 2, int(pid), cpu_devices=2, timeout_s=120)
    with np.load(Path(tmp) / "batches.npz") as z:
        batches: list[dict[str, np.ndarray]] = [{}, {}]
        for key in z.files:
            i, name = key.split("/", 1)
            batches[int(i)][name] = z[key]
    t = load(
        bundle, options=LoadOptions.from_keywords(cache_dir=False, devices="all", layout="fsdp")
    )
    t.run(batches, 2)
    got = _measure(t, Path(tmp) / "job", int(pid) == 0)
    (Path(tmp) / f"child-{pid}.json").write_text(json.dumps(got))
    return 0


def _measure(t: Any, folder: Path, writes: bool) -> dict[str, Any]:
    """State bytes, largest tensor, the peaks, whether the files and states are the same.

    ``writes``: this process writes the files (process 0 of a job; the others join)."""
    from stepbundle.runtime import _compat
    from stepbundle.runtime.state.checkpoint import read_checkpoint, write_checkpoint
    from stepbundle.runtime.state.named import check_state_values, named_values

    folder.mkdir(parents=True, exist_ok=True)
    state = t.state_dict()
    total = sum(v.nbytes for v in state.values())
    largest = max(v.nbytes for v in state.values())
    store = t._store
    meta = _meta(t)
    gathered_file = folder / "gathered.safetensors"
    streamed_file = folder / "streamed.safetensors"

    def gathered() -> None:
        hosts = (_compat.to_host(b) for b in store.buffers)
        values = named_values(store.layout, hosts)
        for e in t.manifest.state:  # tied weights under each name
            for alias in e.aliases:
                values[alias] = values[e.name]
        if writes:
            write_checkpoint(gathered_file, values, meta)

    def restore_whole() -> None:
        values, _ = read_checkpoint(streamed_file)
        store.put(check_state_values(t.manifest, values))

    out: dict[str, Any] = {"total": total, "largest": largest}
    out["write_gathered"] = _peak(gathered)
    out["write_streamed"] = _peak(lambda: t.save_checkpoint(streamed_file))
    out["same_file"] = gathered_file.read_bytes() == streamed_file.read_bytes() if writes else True
    out["restore_whole"] = _peak(restore_whole)
    out["restore_streamed"] = _peak(lambda: t.load_checkpoint(streamed_file))
    after = t.state_dict()
    out["same_state"] = all(np.array_equal(after[k], v) for k, v in state.items())
    return out


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
