"""One process of a 2-process data-parallel run that reads a dataset folder through the
loader (started by test_data_parallel.py's dataset test).

Usage: dp_data_child.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS DATASET OUT_DIR

Each process reads only its own rows of every global batch; the job's losses and state
go to OUT_DIR/process-<id>.npz with the indices of the rows this process gathered.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_helpers import golden_bundle

from stepbundle.runtime import CompileOptions, LoadOptions, ParallelOptions, load
from stepbundle.runtime.data.dataset import open_dataset
from stepbundle.runtime.data.loader import Loader
from stepbundle.runtime.placement import distributed

STEPS = 6


def main() -> None:
    pid, nproc, port, per, data, out = sys.argv[1:7]
    distributed.initialize(
        f"localhost:{port}", int(nproc), int(pid), cpu_devices=int(per), timeout_s=60
    )
    trainer = load(
        golden_bundle("linear_adamw"),
        options=LoadOptions(
            compile=CompileOptions(cache_dir=False), parallel=ParallelOptions(devices="all")
        ),
    )
    dataset = open_dataset(data)
    seen: list[np.ndarray] = []
    gather = dataset.gather

    def recording_gather(indices: np.ndarray) -> dict[str, np.ndarray]:
        seen.append(np.array(indices))
        return gather(indices)

    object.__setattr__(dataset, "gather", recording_gather)
    loader = Loader(dataset, 8, seed=3, process_index=int(pid), process_count=int(nproc))
    metrics = trainer.run(loader, STEPS)
    state = trainer.state_dict()
    np.savez(
        Path(out) / f"process-{pid}.npz",
        losses=np.array([float(m["loss"]) for m in metrics]),
        rows=np.concatenate(seen),
        **{f"state/{k}": v for k, v in state.items()},
    )


if __name__ == "__main__":
    main()
