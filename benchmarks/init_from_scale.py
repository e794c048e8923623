"""Host memory of starting a weights-free 1.1B bundle from a sharded Hugging Face checkpoint
(issue #40, item 3): ``place_state`` reading shard by shard.

Writes a synthetic sharded checkpoint for every ``external`` state entry of BUNDLE
(normal * 0.02, integers zero; ``safetensors.numpy.save_file``, shards of at most ``--shard-gb``,
with a ``model.safetensors.index.json`` as ``save_pretrained`` writes it), then, in a fresh
process of the lean environment, opens it as ``--init-from`` does (``open_source``),
plans the initial state (``plan_initial_state``) and runs ``place_state`` with a ``put``
that reads every byte of each host array (a float64 sum) and keeps nothing: the host
side of a load onto an accelerator, whose device buffers are not host memory. (On this
CPU-only machine a real placement would hold the 13 GB of parameters and AdamW moments in
host memory as the "device".) Reports VmHWM during the placement minus VmRSS before it,
beside the largest shard and the largest tensor. Usage::

    .venv-torch/bin/python benchmarks/export_scale.py ...   # or any weights-free bundle
    .venv-lean/bin/python benchmarks/init_from_scale.py BUNDLE --out benchmarks/results/init_from_scale.json

Imports: numpy, safetensors, stepbundle.runtime and stepbundle.schema (no torch).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
GB = 1e9


def write_checkpoint(bundle: str, folder: Path, shard_bytes: int) -> dict[str, Any]:
    from safetensors.numpy import save_file

    from stepbundle.schema import open_bundle
    from stepbundle.schema.manifest import SectionKind

    with open_bundle(bundle) as b:
        m = b.manifest
        wanted = [e for e in m.state if m.section(e.section).kind is SectionKind.EXTERNAL]
    from stepbundle.runtime.dtypes import NUMPY_DTYPES

    rng = np.random.default_rng(0)

    def nbytes(e: Any) -> int:
        return int(np.prod(e.spec.shape)) * NUMPY_DTYPES[e.spec.dtype].itemsize

    def value(e: Any) -> np.ndarray[Any, Any]:
        dt = NUMPY_DTYPES[e.spec.dtype]
        if dt.kind != "f":  # integer buffers (counters): zeros
            return np.zeros(e.spec.shape, dt)
        return (rng.standard_normal(e.spec.shape, dtype=np.float32) * 0.02).astype(dt)

    shards: list[list[Any]] = [[]]
    size = 0
    for e in wanted:
        n = nbytes(e)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n
    weight_map: dict[str, str] = {}
    sizes = []
    for i, entries in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {e.name: value(e) for e in entries}
        save_file(arrays, str(folder / name))
        sizes.append((folder / name).stat().st_size)
        weight_map.update({e.name: name for e in entries})
        del arrays
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    largest_tensor = max(nbytes(e) for e in wanted)
    return {
        "tensors": len(wanted),
        "shards": len(sizes),
        "checkpoint_bytes": sum(sizes),
        "largest_shard_bytes": max(sizes),
        "largest_tensor_bytes": largest_tensor,
    }


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def measure_placement(
    manifest: Any, source: Any, section: Callable[[str], memoryview]
) -> dict[str, Any]:
    """Run ``place_state`` for ``manifest`` from ``source`` (an open ``InitSource``) with
    a ``put`` that reads every byte and keeps nothing, and measure this process's memory
    around it (``tests/runtime/test_init_from_shards.py`` uses it too)."""
    from stepbundle.runtime.placement.packing import unpacked
    from stepbundle.runtime.state.init_state import place_state, plan_initial_state

    class Read:  # what a device put returns; block_until_ready has nothing to wait for
        def block_until_ready(self) -> None:
            pass

    total = 0.0
    read_bytes = 0

    def put(name: str, host: np.ndarray[Any, Any]) -> Read:
        nonlocal total, read_bytes
        total += float(host.sum(dtype=np.float64))  # touches every byte, as a copy would
        read_bytes += host.nbytes
        return Read()

    plan = plan_initial_state(manifest, source)
    gc.collect()
    before = {k: _status_kb(k) for k in ("VmRSS", "VmHWM", "RssFile", "RssAnon")}
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here
        f.write("5")
    t0 = time.perf_counter()
    place_state(manifest, unpacked(manifest), plan, section, put)
    seconds = time.perf_counter() - t0
    after = {k: _status_kb(k) for k in ("VmRSS", "VmHWM", "RssFile", "RssAnon")}
    return {
        "before": before,
        "after": after,
        "placement_peak_beyond_baseline_bytes": (after["VmHWM"] - before["VmRSS"]) * 1024,
        "process_peak_bytes": after["VmHWM"] * 1024,
        "read_bytes": read_bytes,
        "seconds": seconds,
        "checksum": total,
    }


def child(bundle: str, index: str) -> None:
    from stepbundle.runtime.state.init_source import open_source
    from stepbundle.schema import open_bundle

    with open_bundle(bundle) as b, open_source(index) as source:
        print(json.dumps(measure_placement(b.manifest, source, b.section)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--work", default=None, help="folder for the checkpoint (removed after)")
    ap.add_argument("--out", default=str(HERE / "results" / "init_from_scale.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    work = Path(tempfile.mkdtemp(prefix="stepbundle-init-scale-", dir=args.work))
    try:
        t0 = time.perf_counter()
        ckpt = write_checkpoint(args.bundle, work, int(args.shard_gb * GB))
        ckpt["write_seconds"] = time.perf_counter() - t0
        proc = subprocess.run(
            [sys.executable, __file__, "--child", args.bundle,
             str(work / "model.safetensors.index.json")],
            capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"the measured child failed:\n{proc.stderr[-3000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak = got["placement_peak_beyond_baseline_bytes"]
    result = {
        "benchmark": "init_from_scale",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "bundle": os.path.basename(args.bundle),
        "checkpoint": ckpt,
        "placement": got,
        "peak_over_largest_shard": peak / ckpt["largest_shard_bytes"],
        "peak_over_largest_tensor": peak / ckpt["largest_tensor_bytes"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{ckpt['tensors']} tensors, {ckpt['shards']} shards, {ckpt['checkpoint_bytes'] / GB:.2f} GB "
        f"(largest shard {ckpt['largest_shard_bytes'] / GB:.2f} GB, largest tensor "
        f"{ckpt['largest_tensor_bytes'] / GB:.3f} GB): placement read {got['read_bytes'] / GB:.2f} GB "
        f"in {got['seconds']:.1f} s, host peak beyond baseline {peak / GB:.3f} GB "
        f"({result['peak_over_largest_shard']:.2f}x the largest shard, "
        f"{result['peak_over_largest_tensor']:.2f}x the largest tensor)"
    )


if __name__ == "__main__":
    main()
