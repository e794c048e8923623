"""A process with 8 virtual CPU devices that runs a bundle with the fused attention kernels
(interpreted) forced into its program, in several parallel layouts.

Used by test_mesh_attention.py (the test process itself has 4 devices: tests/conftest.py).
Usage: mesh_attention_child.py BUNDLE BATCHES.npz STEPS OUT_DIR LAYOUT [LAYOUT ...]
Writes OUT_DIR/<layout>.npz: the losses, every state tensor (``state.<name>``), how many
attentions were fused (``fused``) and the shapes of the compiled program's (T, T)
buffers (``tt_shapes``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from stepbundle.runtime import LoadOptions, load  # noqa: E402
from stepbundle.runtime.compile import rewrites  # noqa: E402
from stepbundle.runtime.train.batches import iter_batches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_mesh_attention import forced_kernels, square_buffers  # noqa: E402


def main() -> None:
    bundle, batches_file, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with np.load(batches_file) as z:
        arrays = {k: z[k] for k in z.files}
    for layout in sys.argv[5:]:
        options = LoadOptions.from_keywords(cache_dir=False, devices=8, layout=layout)
        with forced_kernels():
            trainer = load(bundle, options=options)
        batches = iter_batches(arrays)
        losses = [float(m["loss"]) for m in trainer.run(batches, steps)]
        state = {f"state.{k}": v for k, v in trainer.state_dict().items()}
        first = {k: v[0] for k, v in arrays.items()}
        shapes = square_buffers(trainer, first)
        np.savez(
            Path(out) / f"{layout}.npz",
            losses=np.array(losses),
            fused=np.array(trainer.load_info.fused_attention.get("train[0]", 0)),
            tt_shapes=np.array(shapes, dtype=str),
            **state,
        )


if __name__ == "__main__":
    assert rewrites.REWRITES  # the module the fixture patches
    main()
