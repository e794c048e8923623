"""torch_xla's time to first step in a fresh process: what stepbundle's cold start is set against.

Run by benchmarks/run.py as ``python benchmarks/xla_first_step.py CASE_JSON BATCH CACHE_DIR``;
prints one JSON object on its last line. It does what a torch_xla training script does
before its first step: import torch and torch_xla, build the model and AdamW on the XLA
device, then run one step (trace, compile, execute) and read its loss. CACHE_DIR is
torch_xla's persistent compile cache (``torch_xla.runtime.initialize_cache``): an empty
folder for a cold start, the folder an earlier process filled for a warm one. A second
step is timed too: the retrace every later step pays, its compilation cached in memory.
"""

from __future__ import annotations

import json
import sys
import time

T_START = time.perf_counter()


def main(argv: list[str]) -> int:
    case_json, batch_path, cache_dir = argv
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    xr.initialize_cache(cache_dir, readonly=False)  # before the first computation
    dev = torch_xla.device()
    t_import = time.perf_counter()

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import models

    from stepbundle.exporter.workspace import move_to_device

    spec = json.loads(case_json)
    gpt = models.GPTConfig(**spec["gpt"]) if spec.get("gpt") else None
    case = models.Case(spec["name"], spec["depth"], gpt)
    model = models.build_model(case)
    opt = models.adamw(model, for_export=True)
    move_to_device(model, opt, dev)
    model.train()
    step = models.step_fn(case)
    torch_xla.sync()
    with np.load(batch_path) as z:
        batch = {k: torch.from_numpy(z[k]) for k in z.files}
    t_setup = time.perf_counter()

    def one() -> float:
        out = step(model, opt, {k: v.to(dev) for k, v in batch.items()})
        torch_xla.sync()
        return float(out["loss"].item())

    loss = one()
    t_first = time.perf_counter()
    one()
    t_second = time.perf_counter()
    print(
        json.dumps(
            {
                "import_s": t_import - T_START,
                "setup_s": t_setup - t_import,
                "first_step_s": t_first - t_setup,
                "second_step_s": t_second - t_first,
                "start_to_first_step_s": t_first - T_START,
                "loss": loss,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
