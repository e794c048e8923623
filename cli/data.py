"""Where ``stepbundle run`` and ``stepbundle eval`` get their batches.

``--data`` (and ``--eval-data``) is either an ``.npz`` of stacked batches, one
``(S, *batch shape)`` array per batch input (small data, held in memory; step ``i`` uses
batch ``i % S``), or a dataset folder (``dataset.json`` and sharded ``.npy`` files,
``stepbundle.runtime.data.dataset``), read through a ``Loader``: memory-mapped, never loaded
whole, shuffled by seed per epoch, its position stored in checkpoints; or, for a language
model, a ``.npy`` of token ids (one 1-D integer array), read as a ``TokenStream``: windows
of the bundle's context at seeded random offsets, its position stored in checkpoints.

Imports: numpy, the runtime's dataset and loader (lazily).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepbundle.schema.errors import UsageError

if TYPE_CHECKING:
    from stepbundle.runtime import Trainer
    from stepbundle.runtime.data.tokens import TokenStream

    from .config import RunConfig

__all__ = [
    "DATA_ERRORS",
    "NOT_READ",
    "check_steps_per_call",
    "default_batch_size",
    "eval_batches",
    "is_dataset",
    "is_tokens",
    "open_data",
    "read_npz",
    "training_batches",
]

# What reading an .npz can raise for a file that is not a good one.
DATA_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def is_dataset(path: str) -> bool:
    """Whether ``path`` is a dataset folder (rather than an ``.npz``)."""
    return Path(path).is_dir()


def is_tokens(path: str) -> bool:
    """Whether ``path`` is a token stream: a ``.npy`` file (one 1-D array of token ids)."""
    return Path(path).suffix == ".npy" and not Path(path).is_dir()


def token_stream(args: RunConfig, trainer: Trainer, processes: tuple[int, int]) -> TokenStream:
    """A ``TokenStream`` over ``--data`` for the bundle's train batch: one integer input
    of shape (B, T) (the window) or two (the window and its targets, shifted by one).

    Raises:
      ValueError: the bundle's batch is not token windows; the message says what it is.
    """
    from stepbundle.runtime.data.tokens import TokenStream, open_tokens
    from stepbundle.runtime.dtypes import to_numpy

    batch = trainer.manifest.entries["train"].programs[0].batch
    shapes = {tuple(b.spec.shape) for b in batch}
    kinds = {to_numpy(b.spec.dtype).kind for b in batch}
    if len(batch) not in (1, 2) or len(shapes) != 1 or kinds - {"i", "u"}:
        described = ", ".join(f"{b.name}: {b.spec.dtype.value}{list(b.spec.shape)}" for b in batch)
        raise UsageError(
            f"--data {args.data} is a token stream (a .npy of token ids), which feeds a "
            "batch of one or two integer (batch, context) inputs (the window, and its "
            f"targets shifted by one token); this bundle's train batch is {described}. "
            "Pass an .npz of batches or a dataset folder instead."
        )
    (shape,) = shapes
    if len(shape) != 2:
        raise UsageError(
            f"--data {args.data} is a token stream, whose windows are (batch, context); "
            f"this bundle's token inputs have the shape {list(shape)}."
        )
    return TokenStream(
        open_tokens(args.data),
        args.batch_size or shape[0],
        shape[1],
        inputs=[b.name for b in batch],
        dtype=to_numpy(batch[0].spec.dtype),
        seed=args.shuffle_seed,
        process_index=processes[0],
        process_count=processes[1],
        state=trainer.data_position,
    )


_NPY_HEADER_READERS: dict[tuple[int, int], Any] = {}


def read_npz(path: str) -> dict[str, Any]:
    """Read an ``.npz`` of stacked batches, refusing what is not one before reading it.

    Every member's header is read first and its declared size compared with what the
    archive holds, so a damaged or hostile header is an error, not a huge allocation.
    """
    import numpy as np

    Path(path).stat()  # a missing file is "no such file", not "not an archive"
    _NPY_HEADER_READERS.setdefault((1, 0), np.lib.format.read_array_header_1_0)
    _NPY_HEADER_READERS.setdefault((2, 0), np.lib.format.read_array_header_2_0)
    if not zipfile.is_zipfile(path):
        raise UsageError(
            "it is not an .npz archive (write one with numpy.savez(path, x=xs, y=ys), one "
            "(S, *batch shape) array per batch input)"
        )
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = _NPY_HEADER_READERS.get(version)
                if read_header is None:  # format 3.0 (utf-8 names): np.load checks it
                    continue
                shape, _, dtype = read_header(member)
                if dtype.hasobject:
                    raise UsageError(f"{info.filename} holds Python objects, not numbers")
                declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
                if declared > info.file_size:
                    raise UsageError(
                        f"{info.filename} declares {shape} {dtype} ({declared} bytes) but the "
                        f"archive holds {info.file_size} bytes for it: the file is damaged"
                    )
    with np.load(path, allow_pickle=False) as npz:
        data = {k: npz[k] for k in npz.files}
    if not data:
        raise UsageError("it holds no arrays")
    if any(a.ndim >= 1 and a.shape[0] == 0 for a in data.values()):
        raise UsageError("it holds 0 batches (every array's first dimension is the batch count)")
    return data


def default_batch_size(trainer: Trainer, entry: str) -> int:
    """The rows of ``entry``'s first shape bucket: the batch size the bundle was traced with."""
    program = trainer.manifest.entries[entry].programs[0]
    sizes = {b.spec.shape[0] for b in program.batch if b.spec.shape}
    if len(sizes) != 1:
        raise UsageError(
            f"The bundle's {entry!r} batches have no single batch size ({sorted(sizes)}); "
            f"pass {'--batch-size' if entry == 'train' else '--eval-batch-size'}."
        )
    return int(sizes.pop())


def training_batches(
    args: RunConfig, trainer: Trainer, npz: Mapping[str, Any] | None
) -> tuple[Iterable[Mapping[str, Any]], int]:
    """The training batches and the step offset ``Trainer.run`` takes.

    For an ``.npz``: the batches, cycled from the trainer's step count. For a dataset
    folder: a ``Loader`` over this process's rows of each global batch, continuing from
    the checkpoint's data position after ``--resume``.
    """
    from stepbundle.runtime.train.batches import iter_batches

    if npz is not None:
        return iter_batches(npz), trainer.step_count
    import jax

    from stepbundle.runtime.data.dataset import open_dataset
    from stepbundle.runtime.data.loader import Loader

    # Each process of a job reads only its own slice of every global batch.
    processes = sorted({d.process_index for d in trainer.placement.devices})
    me = jax.process_index()
    if is_tokens(args.data):
        return token_stream(args, trainer, (processes.index(me), len(processes))), 0
    loader = Loader(
        open_dataset(args.data),
        args.batch_size or default_batch_size(trainer, "train"),
        seed=args.shuffle_seed,
        shuffle=not args.no_shuffle,
        epochs=args.epochs,
        last_batch=args.last_batch,
        process_index=processes.index(me),
        process_count=len(processes),
        state=trainer.data_position,
    )
    return loader, 0


def eval_batches(
    path: str, trainer: Trainer, entry: str, batch_size: int | None
) -> tuple[Any, str | None]:
    """Batches of a whole evaluation set, in order, and the key of their row mask."""
    from stepbundle.runtime.data.dataset import open_dataset
    from stepbundle.runtime.data.loader import Loader
    from stepbundle.runtime.train.batches import iter_batches

    if not is_dataset(path):
        return iter_batches(read_npz(path)), None
    mask = "__stepbundle_mask__"
    return (
        Loader(
            open_dataset(path),
            batch_size or default_batch_size(trainer, entry),
            shuffle=False,
            epochs=1,
            last_batch="pad",
            mask_key=mask,
        ),
        mask,
    )


NOT_READ = object()
"""``open_data`` has not run yet (a multi-process job reads its data after joining)."""


def open_data(args: RunConfig) -> Any:
    """Open --data and --eval-data (a dataset folder's index, or an .npz file read whole)
    before the bundle is compiled: --eval-data is not first read at the first evaluation,
    maybe hours in. Returns the --data .npz's arrays, or None for a folder.

    Raises:
      ValueError: a data set cannot be read; the message names its flag.
    """
    from stepbundle.schema.errors import StepbundleError

    npz = None
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        try:
            if not path:
                continue
            if is_dataset(path):
                from stepbundle.runtime.data.dataset import open_dataset

                open_dataset(path)
            elif flag == "--data" and is_tokens(path):
                from stepbundle.runtime.data.tokens import open_tokens

                open_tokens(path)
            elif flag == "--data":
                npz = read_npz(path)
            else:
                read_npz(path)
        except (*DATA_ERRORS, StepbundleError) as e:
            raise UsageError(f"cannot read {flag} {path!r}: {e}") from None
    return npz


# Host bytes a K-step call holds per step beyond its batch: the group's tuple and dict.
_STEP_OVERHEAD = 1024


def check_steps_per_call(args: RunConfig, npz: Any) -> None:
    """Refuse, before anything is compiled, a ``--steps-per-call K`` whose K batches do
    not fit in this process's memory: a call stacks K batches on the host (and copies the
    stack to the device). ``--steps-per-call 100000000`` on a tiny bundle once ran 160 s
    and took 6.5 GB before a ``MemoryError``.

    The size of a batch is known from an .npz, or from a dataset folder with
    ``--batch-size`` (without it the batch is the bundle's, known only after the load,
    and the runtime's own check refuses it then).

    Raises:
      ValueError: K batches cannot fit; the message says how large they are.
    """
    import math

    from stepbundle.runtime.io.host_memory import available_bytes, format_bytes

    k = args.steps_per_call
    if not isinstance(k, int) or k <= 1 or args.entry != "train":
        return
    per_batch: int | None = None
    if isinstance(npz, Mapping) and npz:
        per_batch = sum(a.nbytes // max(1, a.shape[0]) for a in npz.values() if a.ndim)
    elif is_dataset(args.data) and args.batch_size:
        from stepbundle.runtime.data.dataset import open_dataset

        specs = open_dataset(args.data).inputs
        row = sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)
        per_batch = row * args.batch_size
    if per_batch is None:
        return
    steps = args.steps
    held = min(k, steps) if isinstance(steps, int) else k  # a call takes at most --steps
    need = held * (2 * per_batch + _STEP_OVERHEAD)
    avail = available_bytes()
    if avail is not None and need > avail:
        raise UsageError(
            f"--steps-per-call {k} stacks {held} batches of --data ({format_bytes(per_batch)} "
            f"each) in host memory for every call, {format_bytes(need)} with the copies a "
            f"call makes, and this process can allocate {format_bytes(avail)}. Use a much "
            "smaller K (8 or 32 take most of the gain; 'auto' picks one), e.g. "
            "--steps-per-call 32."
        )
