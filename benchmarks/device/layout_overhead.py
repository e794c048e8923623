"""What a parallel layout costs on one chip: the 55M GPT's step time under ``--layout dp``
and ``--layout fsdp`` (or any specs) on one device, side by side.

    # here, with torch_xla (the exporter): the weights-free bundle of gpt.py
    .venv/bin/python benchmarks/device/gpt.py export -o build/tpu/gpt55m.stepbundle
    # on the device machine
    python benchmarks/device/layout_overhead.py build/tpu/gpt55m.stepbundle --out overhead.json

Each layout's trainer starts from the same initial state (``gpt.initial_state``, through
``init_from``) and runs the same batches; the first losses must agree. The timing
alternates between the layouts (``--rounds`` rounds of ``--steps`` steps each, the loss
read back at the end of each round) and reports the median ms per step of each. It also
records whether the compiled programs are the same HLO text: on one device a layout has
no axis to split over (``shard_plan.plan_shards`` splits nothing when the data axis is 1),
so the program, and the time, should be the same.

Imports: numpy, jax, stepbundle.runtime, gpt.py (numpy only at import).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle")
    p.add_argument("--layouts", nargs="+", default=["dp", "fsdp"])
    p.add_argument("--platform", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workdir", default="/tmp/layout_overhead")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import jax

    from stepbundle.runtime import LoadOptions, load
    from stepbundle.runtime.state.checkpoint import write_safetensors

    platform = a.platform or jax.default_backend()
    init = Path(a.workdir) / "gpt55m-init.safetensors"
    init.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(init, gpt.initial_state())
    trainers: dict[str, Any] = {}
    out: dict[str, Any] = {"jax": jax.__version__, "platform": platform, "layouts": {}}
    for layout in a.layouts:
        options = LoadOptions.from_keywords(init_from=init, cache_dir=False, layout=layout)
        t = load(a.bundle, platform, options)
        trainers[layout] = t
        out["layouts"][layout] = {
            "load_info_layout": t.load_info.layout,
            "mesh": t.load_info.mesh,
            "state_bytes_per_device": t.load_info.state_bytes_per_device,
            "compile_s": t.load_info.seconds.get("compile"),
        }
    data = gpt.batches(4)
    # Host batches: the trainer copies them (i64, 128 KiB a step) with its own x64
    # transfer, as gpt.py's bench does.
    dev_batches = data
    hlo: dict[str, str] = {}
    for layout, t in trainers.items():
        plan, _ = t._dispatcher.pick("train", data[0])
        hlo[layout] = "\n".join(m.to_string() for m in plan.executable.hlo_modules())
        out["layouts"][layout]["first_loss"] = float(t.step(dev_batches[0])["loss"])
    first = a.layouts[0]
    out["same_hlo_as_" + first] = {k: hlo[k] == hlo[first] for k in a.layouts}
    times: dict[str, list[float]] = {k: [] for k in a.layouts}
    for _ in range(a.rounds):
        for layout, t in trainers.items():
            t0 = time.perf_counter()
            m = None
            for i in range(a.steps):
                m = t.step(dev_batches[i % len(dev_batches)])
            float(m["loss"])  # type: ignore[index]
            times[layout].append((time.perf_counter() - t0) / a.steps * 1e3)
    for layout in a.layouts:
        row = out["layouts"][layout]
        row["ms_per_step_rounds"] = times[layout]
        row["ms_per_step_median"] = statistics.median(times[layout])
        print(
            f"{layout:12s} {row['ms_per_step_median']:8.2f} ms/step  first loss "
            f"{row['first_loss']:.6f}  mesh {row['mesh']}  same HLO as {first}: "
            f"{out['same_hlo_as_' + first][layout]}",
            flush=True,
        )
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
