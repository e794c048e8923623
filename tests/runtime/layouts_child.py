"""A process with 8 virtual CPU devices that runs a bundle in several parallel layouts.

Used by test_layouts.py (the test process itself has 4 devices: tests/conftest.py).
Usage: layouts_child.py BUNDLE BATCHES.npz STEPS OUT_DIR LAYOUT [LAYOUT ...]
Writes OUT_DIR/<layout>.npz: the losses, every state tensor (``state.<name>``) and the
state bytes on each device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from stepbundle.runtime import LoadOptions, load  # noqa: E402
from stepbundle.runtime.train.batches import iter_batches  # noqa: E402


def main() -> None:
    bundle, batches_file, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with np.load(batches_file) as z:
        batches = iter_batches({k: z[k] for k in z.files})
    for layout in sys.argv[5:]:
        options = LoadOptions.from_keywords(cache_dir=False, devices=8, layout=layout)
        trainer = load(bundle, options=options)
        losses = [float(m["loss"]) for m in trainer.run(batches, steps)]
        state = {f"state.{k}": v for k, v in trainer.state_dict().items()}
        nbytes = np.array(sorted(trainer.state_bytes_per_device().values()))
        np.savez(Path(out) / f"{layout}.npz", losses=np.array(losses), bytes=nbytes, **state)


if __name__ == "__main__":
    main()
