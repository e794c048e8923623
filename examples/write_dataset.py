"""Write a PyTorch dataset to stepbundle's on-disk layout (sharded, memory-mapped .npy files).

Usage: .venv/bin/python examples/write_dataset.py OUT_DIR [ROWS]

The dataset here is a synthetic CIFAR-sized one (no downloads): ``ROWS`` images of
32x32x3 uint8 and int64 labels in 0..9, behind an ordinary ``torch.utils.data.Dataset``.
Any map-style or iterable dataset works the same way:

1. Read it in batches with a ``DataLoader`` (``shuffle=False``: the order on disk is
   the dataset's own; the runtime's loader shuffles by seed every epoch).
2. Turn each batch into numpy arrays named like the bundle's batch inputs (here ``x``
   and ``y``), in the dtype and per-row shape the exported step expects. Keep images
   uint8 on disk (4x smaller than float32) only if the step itself converts them;
   otherwise convert here.
3. Hand the chunks to ``write_dataset(..., stacked=True)``: it streams them into
   shards of about 64 MB, never holding the whole dataset, and writes ``dataset.json``
   last.

Then train from it with the runtime (no torch in that process)::

    from stepbundle.runtime.data.dataset import open_dataset
    from stepbundle.runtime.data.loader import Loader
    batches = Loader(open_dataset(OUT_DIR), batch_size=128, seed=0, epochs=10)

Imports: torch, numpy, stepbundle.runtime's data modules (numpy only).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from stepbundle.runtime.data.dataset_writer import write_dataset


class SyntheticCifar(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """CIFAR-10's shapes with made-up pixels: image ``i`` is a function of ``i``."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        image = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=g)
        label = torch.tensor(i % 10, dtype=torch.int64)
        return image, label


def numpy_chunks(
    loader: DataLoader[tuple[torch.Tensor, torch.Tensor]],
) -> Iterator[dict[str, np.ndarray]]:
    """The DataLoader's batches as ``{input name: numpy array (n, *row shape)}``."""
    for images, labels in loader:
        yield {"x": images.numpy(), "y": labels.numpy()}


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.split("\n\n")[1])
    out = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) == 3 else 10_000
    loader = DataLoader(SyntheticCifar(rows), batch_size=1000, shuffle=False)
    ds = write_dataset(out, numpy_chunks(loader), stacked=True)
    inputs = ", ".join(f"{s.name}: {s.dtype.name}{list(s.shape)}" for s in ds.inputs)
    print(f"wrote {out}: {ds.rows} rows in {len(ds.shard_rows)} shard(s); {inputs}")


if __name__ == "__main__":
    main()
