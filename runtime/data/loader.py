"""Batches from an on-disk dataset: shuffled by seed, by epoch, per process, resumable.

``Loader`` is a plain iterator of ``dict[name, np.ndarray]`` batches over a
``dataset.Dataset``. What it yields is decided by a few integers only, so a run that
stops and resumes from ``Loader.state()`` gets exactly the batches it would have got:

- **Order.** Epoch ``e`` visits the rows in the order
  ``numpy.random.Generator(PCG64([seed, e])).permutation(rows)`` (``shuffle=True``), or
  ``0, 1, ..., rows-1`` (``shuffle=False``): a fresh permutation every epoch, the same
  one for the same seed, on every process. (NumPy keeps ``Generator.permutation``'s
  stream stable in practice but does not promise it across versions; a resume under
  another numpy could reorder the rest of an epoch, never repeat or drop a row.)
- **Batches.** Batch ``b`` of an epoch is the rows at positions ``[b*B, (b+1)*B)`` of
  that order, ``B`` the global batch size. The epoch's last ``rows % B`` rows make a
  last batch by ``last_batch``: ``"drop"`` (skipped), ``"keep"`` (a smaller batch) or
  ``"pad"`` (a full batch whose missing rows repeat the batch's real rows, so every
  value is a real, finite example, and a mask says which rows are real).
- **Processes.** With ``process_count`` P, process ``p`` gets the rows
  ``[p*B/P, (p+1)*B/P)`` of every global batch (of the padded batch, for ``"pad"``), and
  reads only those from the memory maps: the processes' batches are disjoint and
  concatenated in process order they are exactly the 1-process batch.
- **Epochs.** ``epochs=None`` runs forever; ``epochs=N`` stops after N epochs.

**The mask.** A training step must never receive an input it does not know, so the
mask is not in the batch unless asked for: with ``mask_key="mask"`` every batch (not
only the padded one) carries ``batch["mask"]``, a bool array over the process's rows,
True for a real row; an evaluator pops it before calling the program. Without
``mask_key`` the batches hold the dataset's inputs only (``"pad"`` then still pads).

**The state** (``Loader.state()``) is a small JSON object: where the next batch starts
plus what the position means, so a resume under another configuration is refused
rather than silently different::

    {"format": "stepbundle.loader", "version": 1, "seed": 0, "epoch": 3,
     "batch_in_epoch": 17, "rows": 50000, "batch_size": 32, "shuffle": true,
     "last_batch": "drop"}

It is the same on every process (it counts global batches), so a job may resume with
another process count. ``Loader.set_state`` (or ``Loader(..., state=...)``) continues
from it.

Each ``__next__`` does a slice of the epoch's permutation and ``Dataset.gather``: one
argsort of the batch's row numbers and one fancy index per input per shard touched; no
Python loop per row. The permutation (8 bytes per row) is made once per epoch.

**Why not grain.** grain 0.2.18 (the JAX ecosystem's deterministic, checkpointable
data loader) was evaluated as the engine behind this API, in a scratch venv (Python
3.11.7, 2 shared cores, 2026-12; ``benchmarks/data_pipeline.py --grain`` repeats it):

- It installs cleanly on 3.11, pulling in 11 packages (absl-py, array-record,
  cloudpickle, etils, fsspec, portpicker, protobuf, psutil, typing-extensions, zipp,
  numpy; ~120 MB of site-packages), and its multi-process prefetch (``mp_prefetch``)
  serializes the whole pipeline, Python objects included, into its worker processes.
  The in-process path does not, and its iterator state (``{"next_index": 3123}``) is
  JSON.
- ``MapDataset.shuffle(seed).repeat().batch(32)`` gives a fresh order per epoch, and
  ``get_state``/``set_state`` resumes exactly across an epoch boundary (checked).
- But it fetches and stacks row by row in Python: per batch it took 25-60 times this
  loader's fancy indexing, several times the whole budget a batch has beside a small
  step (docs/data.md has the figures).
- Its multi-process sharding splits the dataset per process, not each global batch
  (the processes' batches are then not slices of the 1-process batch), and it has no
  padded last batch with a mask; both would be written here on top of it anyway.

So the loader is hand-written (numpy only, ~200 lines with its state checks), and
grain is not an extra: it would add 11 dependencies and a Python-object serialization
path to the runtime, for a slower batch. Its ideas are kept: a per-epoch seed, a JSON iterator state, and
a pipeline that is a pure function of (seed, epoch, position).

Imports: numpy, the standard library (and this package's dataset).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..io.host_memory import available_bytes, format_bytes
from .dataset import DataError, DataErrorKind, Dataset

__all__ = ["LOADER_FORMAT", "LOADER_STATE_VERSION", "LastBatch", "Loader", "LoaderState"]

LOADER_FORMAT = "stepbundle.loader"

# The loader state's version. Readers accept every version up to their own.
# 1 (2026-12): {format, version, seed, epoch, batch_in_epoch, rows, batch_size, shuffle,
#   last_batch}; epoch order = PCG64([seed, epoch]).permutation(rows).
LOADER_STATE_VERSION = 1

_STATE_KEYS = (
    "format",
    "version",
    "seed",
    "epoch",
    "batch_in_epoch",
    "rows",
    "batch_size",
    "shuffle",
    "last_batch",
)


class LastBatch(enum.Enum):
    """What to do with an epoch's last ``rows % batch_size`` rows."""

    DROP = "drop"
    """Skip them (this epoch; the next epoch's order differs, so they are seen then)."""
    KEEP = "keep"
    """Yield them as a smaller batch (a program needs a shape bucket for it)."""
    PAD = "pad"
    """Yield a full batch: the real rows, then repeats of them; ``mask_key`` marks which."""


@dataclass(frozen=True)
class LoaderState:
    """A loader's position, and the configuration that gives the position its meaning.

    Attributes:
      seed: the shuffling seed.
      epoch: the epoch of the next batch (0-based).
      batch_in_epoch: the index of the next batch within that epoch.
      rows: the dataset's row count.
      batch_size: the global batch size.
      shuffle: whether epochs are shuffled.
      last_batch: the last-batch rule.
    """

    seed: int
    epoch: int
    batch_in_epoch: int
    rows: int
    batch_size: int
    shuffle: bool
    last_batch: LastBatch

    def to_json(self) -> dict[str, Any]:
        """The JSON object a checkpoint stores (``json.dumps`` takes it as is)."""
        return {
            "format": LOADER_FORMAT,
            "version": LOADER_STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "rows": self.rows,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "last_batch": self.last_batch.value,
        }

    @staticmethod
    def from_json(obj: object) -> LoaderState:
        """Parse ``to_json``'s object, refusing anything else with a ``DataError``."""

        def bad(what: str) -> DataError:
            return DataError(
                DataErrorKind.BAD_STATE,
                f"The loader state {obj!r} is not one Loader.state() wrote: {what}. Store "
                "and pass back Loader.state() unchanged.",
            )

        if not isinstance(obj, Mapping):
            raise bad("it is not a JSON object")
        if obj.get("format") != LOADER_FORMAT:
            raise bad(f"its format is {obj.get('format')!r}, expected {LOADER_FORMAT!r}")
        version = obj.get("version")
        if type(version) is not int or not 1 <= version <= LOADER_STATE_VERSION:
            raise DataError(
                DataErrorKind.BAD_STATE,
                f"The loader state has version {version!r}; this stepbundle reads loader "
                f"states of versions 1 to {LOADER_STATE_VERSION}. Resume with the "
                "stepbundle that wrote it, or upgrade.",
            )
        if set(obj) != set(_STATE_KEYS):
            raise bad(
                f"it must have exactly the keys {list(_STATE_KEYS)}, "
                f"got {sorted(str(k) for k in obj)}"
            )
        ints = {}
        for k in ("seed", "epoch", "batch_in_epoch", "rows", "batch_size"):
            v = obj[k]
            if type(v) is not int or v < 0:
                raise bad(f"{k!r} is {v!r}, expected a non-negative integer")
            ints[k] = v
        if type(obj["shuffle"]) is not bool:
            raise bad(f"'shuffle' is {obj['shuffle']!r}, expected true or false")
        try:
            last = LastBatch(obj["last_batch"])
        except ValueError:
            raise bad(
                f"'last_batch' is {obj['last_batch']!r}, expected one of "
                f"{[m.value for m in LastBatch]}"
            ) from None
        return LoaderState(
            seed=ints["seed"],
            epoch=ints["epoch"],
            batch_in_epoch=ints["batch_in_epoch"],
            rows=ints["rows"],
            batch_size=ints["batch_size"],
            shuffle=bool(obj["shuffle"]),
            last_batch=last,
        )


class Loader:
    """An iterator of batches ``dict[name, np.ndarray]`` over a dataset (see the module).

    Args:
      dataset: an opened dataset (``dataset.open_dataset``).
      batch_size: the global batch size B (all processes together).
      seed: the shuffling seed (a non-negative integer).
      shuffle: shuffle each epoch (True) or read rows in order (False, e.g. evaluation).
      epochs: stop after this many epochs; ``None`` runs forever.
      last_batch: ``"drop"``, ``"keep"`` or ``"pad"`` (or a ``LastBatch``).
      mask_key: if given, every batch also carries this key: a bool array, True for a
        real row (False only for ``"pad"``'s padding). Must not be an input's name.
      process_index, process_count: this process's place in a multi-process job; B must
        be divisible by ``process_count``.
      state: a ``Loader.state()`` to continue from (same as calling ``set_state``).

    Raises:
      DataError (``BAD_LOADER``): the arguments do not fit the dataset.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int | None = None,
        last_batch: LastBatch | str = LastBatch.DROP,
        mask_key: str | None = None,
        process_index: int = 0,
        process_count: int = 1,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        def bad(message: str) -> DataError:
            return DataError(DataErrorKind.BAD_LOADER, message, path=dataset.path)

        if type(batch_size) is not int or batch_size < 1:
            raise bad(f"The batch size must be a positive integer, got {batch_size!r}.")
        if type(seed) is not int or seed < 0:
            raise bad(f"The seed must be a non-negative integer, got {seed!r}.")
        if epochs is not None and (type(epochs) is not int or epochs < 1):
            raise bad(f"epochs must be a positive integer or None (forever), got {epochs!r}.")
        try:
            last = LastBatch(last_batch)
        except ValueError:
            raise bad(
                f"last_batch must be one of {[m.value for m in LastBatch]}, got {last_batch!r}."
            ) from None
        if type(process_count) is not int or process_count < 1:
            raise bad(f"process_count must be a positive integer, got {process_count!r}.")
        if type(process_index) is not int or not 0 <= process_index < process_count:
            raise bad(f"process_index must lie in [0, {process_count}), got {process_index!r}.")
        if batch_size % process_count:
            raise bad(
                f"The global batch size {batch_size} does not split evenly over "
                f"{process_count} processes; use a multiple of {process_count}."
            )
        if mask_key is not None and mask_key in dataset.names:
            raise bad(
                f"mask_key {mask_key!r} is also an input of the dataset; choose another "
                "name for the mask."
            )
        full, rest = divmod(dataset.rows, batch_size)
        if last is LastBatch.DROP and full == 0:
            raise bad(
                f"The dataset {dataset.path!r} has {dataset.rows} rows, fewer than one "
                f"batch of {batch_size}, and last_batch='drop' would yield nothing; use a "
                "smaller batch, or last_batch='keep' or 'pad'."
            )
        if last is LastBatch.KEEP and rest % process_count:
            raise bad(
                f"last_batch='keep' leaves a last batch of {rest} rows ({dataset.rows} rows, "
                f"batch {batch_size}) that {process_count} processes cannot split evenly "
                "(every process's batch must have the same shape); use 'pad' or 'drop'."
            )
        # Refused before the first batch allocates: its rows, and ~8 int64 row numbers
        # per row on the way (the permutation's slice, argsort, shard numbers...).
        rows_read = (batch_size if last is LastBatch.PAD else min(batch_size, dataset.rows)) // (
            process_count
        )
        need = rows_read * (sum(s.row_bytes for s in dataset.inputs) + 64)
        have = available_bytes()
        if have is not None and need > have:
            raise bad(
                f"A batch of {batch_size} rows of {dataset.path!r} needs about "
                f"{format_bytes(need)} of host memory to read (per process), more than the "
                f"{format_bytes(have)} this process has available. Use a smaller batch "
                "size (--batch-size), or run where there is more memory."
            )
        if last is LastBatch.PAD and mask_key is None and batch_size > dataset.rows:
            raise bad(
                f"The batch of {batch_size} rows is larger than the dataset "
                f"{dataset.path!r}, which has {dataset.rows} rows: with last_batch='pad' "
                f"every training batch would be the whole dataset plus "
                f"{batch_size - dataset.rows} repeats of its rows. Use a batch size of at "
                f"most {dataset.rows} (--batch-size), or a larger dataset."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.last_batch = last
        self.mask_key = mask_key
        self.process_index = process_index
        self.process_count = process_count
        self.local_batch_size = batch_size // process_count
        self.batches_per_epoch = full + (1 if rest and last is not LastBatch.DROP else 0)
        """Batches per epoch (the same for every epoch and process)."""
        self._rest = rest
        self._epoch = 0
        self._batch = 0
        self._order_epoch = -1
        self._order: np.ndarray[Any, np.dtype[np.int64]] = np.empty(0, dtype=np.int64)
        if state is not None:
            self.set_state(state)

    # -- position -----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Where the next batch starts, as the JSON object a checkpoint stores."""
        return self.loader_state().to_json()

    def loader_state(self) -> LoaderState:
        """``state()`` as a typed record."""
        return LoaderState(
            seed=self.seed,
            epoch=self._epoch,
            batch_in_epoch=self._batch,
            rows=self.dataset.rows,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            last_batch=self.last_batch,
        )

    def set_state(self, state: Mapping[str, Any] | LoaderState) -> None:
        """Continue from ``state`` (a ``state()`` of a loader of the same configuration).

        Raises:
          DataError (``BAD_STATE``): the state is malformed, or was saved by a loader
            with another seed, dataset size, batch size, shuffle or last-batch rule
            (each named with both values).
        """
        s = state if isinstance(state, LoaderState) else LoaderState.from_json(state)
        mine = self.loader_state()
        diffs = [
            f"{k} {getattr(s, k)!r} (saved) vs {getattr(mine, k)!r} (this loader)"
            for k in ("seed", "rows", "batch_size", "shuffle", "last_batch")
            if getattr(s, k) != getattr(mine, k)
        ]
        if diffs:
            raise DataError(
                DataErrorKind.BAD_STATE,
                "The saved data position belongs to another loader configuration: "
                + "; ".join(diffs)
                + ". Resuming would give other batches than the interrupted run; build the "
                "loader with the saved values (or start the data from the beginning).",
                path=self.dataset.path,
            )
        if s.batch_in_epoch >= self.batches_per_epoch:
            raise DataError(
                DataErrorKind.BAD_STATE,
                f"The saved data position is batch {s.batch_in_epoch} of epoch {s.epoch}, "
                f"but an epoch has {self.batches_per_epoch} batches. Store and pass back "
                "Loader.state() unchanged.",
                path=self.dataset.path,
            )
        self._epoch = s.epoch
        self._batch = s.batch_in_epoch

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self._epoch

    @property
    def exhausted(self) -> bool:
        """True once ``epochs`` epochs have been yielded."""
        return self.epochs is not None and self._epoch >= self.epochs

    # -- iteration ----------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The global row order of ``epoch`` (the same on every process)."""
        if not self.shuffle:
            return np.arange(self.dataset.rows, dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        return rng.permutation(self.dataset.rows).astype(np.int64, copy=False)

    def __iter__(self) -> Iterator[dict[str, np.ndarray[Any, Any]]]:
        return self

    def __next__(self) -> dict[str, np.ndarray[Any, Any]]:
        if self.exhausted:
            raise StopIteration
        if self._order_epoch != self._epoch:
            self._order = self.epoch_order(self._epoch)
            self._order_epoch = self._epoch
        b = self.batch_size
        start = self._batch * b
        real = min(b, self.dataset.rows - start)  # rows of this global batch that exist
        # This process's slots [lo, hi) of the global batch (padded to b for "pad").
        size = real if self.last_batch is LastBatch.KEEP else b
        local = size // self.process_count
        lo = self.process_index * local
        hi = lo + local
        slots = np.arange(lo, hi, dtype=np.int64)
        if real < b and self.last_batch is LastBatch.PAD:
            valid = slots < real
            rows = self._order[start + slots % real]
        else:
            valid = None
            rows = self._order[start + lo : start + hi]
        batch = self.dataset.gather(rows)
        if self.mask_key is not None:
            batch[self.mask_key] = valid if valid is not None else np.ones(local, dtype=np.bool_)
        self._batch += 1
        if self._batch >= self.batches_per_epoch:
            self._epoch += 1
            self._batch = 0
        return batch
