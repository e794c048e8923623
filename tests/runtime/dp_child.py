"""One process of a multi-process data-parallel run (started by test_data_parallel.py).

Usage: dp_child.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS NAME OUT_DIR [MODE]

Joins the job through jax.distributed on localhost, loads the golden bundle NAME over
every device of the job, runs its golden steps, saves a checkpoint (written by process
0), and writes this process's losses and state to OUT_DIR/process-<id>.npz.

MODE ``zero1`` splits the optimizer state over the devices of both processes, ``fsdp``
all of the state. MODE ``partial`` loads on the first 2 devices only (all of them
process 0's) and prints what ``load`` raised. MODE ``unwritable`` (``unwritable-fsdp``:
under FSDP) saves a checkpoint where process 0 cannot write, and prints what each
process raised.

After the checkpoint is saved every process restores it into its trainer, and writes
the state it then holds as well (``restored/`` keys).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_helpers import GOLDEN_SCHEDULES, GOLDEN_STEPS, golden_batches, golden_bundle

from stepbundle.runtime import CompileOptions, LoadOptions, ParallelOptions, load
from stepbundle.runtime.placement import distributed
from stepbundle.runtime.train.schedule import parse_schedule


def main() -> None:
    pid, nproc, port, per, name, out = sys.argv[1:7]
    mode = sys.argv[7] if len(sys.argv) > 7 else ""
    distributed.initialize(
        f"localhost:{port}", int(nproc), int(pid), cpu_devices=int(per), timeout_s=60
    )
    import jax

    assert jax.process_count() == int(nproc)
    if mode == "partial":
        try:
            load(
                golden_bundle(name),
                options=LoadOptions(
                    compile=CompileOptions(cache_dir=False), parallel=ParallelOptions(devices=2)
                ),
            )
        except Exception as e:
            print(f"REFUSED {type(e).__name__}: {e}")
        return
    layout = {"zero1": "zero1", "fsdp": "fsdp", "unwritable-fsdp": "fsdp"}.get(mode, "dp")
    trainer = load(
        golden_bundle(name),
        options=LoadOptions(
            compile=CompileOptions(cache_dir=False),
            parallel=ParallelOptions(devices="all", layout=layout),
        ),
    )
    if mode.startswith("unwritable"):
        trainer.step(golden_batches(name)[0])
        try:
            trainer.save_checkpoint("/proc/stepbundle-cannot-write-here/c.safetensors")
        except Exception as e:
            print(f"RAISED {type(e).__name__}: {e}")
        return
    assert len(trainer.devices) == int(nproc) * int(per)
    if name in GOLDEN_SCHEDULES:
        trainer.set_schedule("lr", parse_schedule(GOLDEN_SCHEDULES[name]))
    metrics = trainer.run(golden_batches(name), GOLDEN_STEPS[name])
    losses = np.array([float(m["loss"]) for m in metrics])
    out_dir = Path(out)
    trainer.save_checkpoint(out_dir / "checkpoint.safetensors")
    # Every process reads the checkpoint process 0 wrote: the save waited for it.
    assert (out_dir / "checkpoint.safetensors").is_file()
    state = trainer.state_dict()
    # Restored on every process, each copying its own devices' pieces from the file.
    trainer.load_checkpoint(out_dir / "checkpoint.safetensors")
    restored = trainer.state_dict()
    np.savez(
        out_dir / f"process-{pid}.npz",
        losses=losses,
        local_devices=np.array([d.id for d in jax.local_devices()]),
        state_bytes=np.array(sorted(trainer.state_bytes_per_device().values())),
        **{f"state/{k}": v for k, v in state.items()},
        **{f"restored/{k}": v for k, v in restored.items()},
    )


if __name__ == "__main__":
    main()
