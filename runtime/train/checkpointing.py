"""Checkpoints of a trainer: save its state and progress, restore them exactly.

``Checkpoints`` is the trainer's part behind ``save_checkpoint`` and ``load_checkpoint``;
it owns nothing of its own and works on the other parts (the state, the progress, the
hyperparameters).

What goes into a checkpoint (state under PyTorch's names, step count, seed,
hyperparameters, schedule specs, the data position) and the agreement of a
multi-process job (process 0 writes, every process joins each gather in one order, all
learn whether the file is in place) are decided here; the file format is ``checkpoint.py``'s.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from stepbundle.schema.manifest import Manifest

from ..errors import BindingError, CheckpointError
from ..placement.sharding import Placement
from ..state.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointMeta,
    check_bundle,
    open_checkpoint,
    write_checkpoint,
    write_order,
)
from ..state.named import OrderedReads, check_state_values
from .hyper import Hyperparameters
from .progress import Progress
from .state_store import StateStore

__all__ = ["Checkpoints"]


class Checkpoints:
    """``Trainer.save_checkpoint`` and ``Trainer.load_checkpoint``."""

    def __init__(
        self,
        *,
        manifest: Manifest,
        digest: str,
        placement: Placement,
        store: StateStore,
        progress: Progress,
        hp: Hyperparameters,
    ) -> None:
        self._manifest = manifest
        self._digest = digest
        self._placement = placement
        self._store = store
        self._progress = progress
        self._hp = hp

    def save(self, path: str | os.PathLike[str]) -> None:
        """``Trainer.save_checkpoint``."""
        meta = CheckpointMeta(
            format=CHECKPOINT_FORMAT,
            step=self._progress.step,
            seed=self._progress.seed,
            hyperparameters=dict(self._hp.values),
            bundle_digest=self._digest,
            schedules=dict(self._hp.specs),
            data=self._progress.data_position,
        )
        # Each tensor is copied from the devices while it is written, so no host holds
        # the whole state (a split tensor is gathered on its own). In a multi-process
        # job reading a tensor split over several processes is a collective: process 0
        # writes, reading in write_order, and every process then joins the gathers of
        # the reads left in that order (all of them, on the others), so they meet in
        # each one whether the write ended or failed part-way.
        streamed = self._store.streamed()
        values: Mapping[str, np.ndarray[Any, Any]] = streamed
        reads: OrderedReads | None = None
        if self._placement.process_count > 1:
            values = reads = OrderedReads(streamed, write_order(streamed))
        failure: CheckpointError | None = None
        if self._placement.writes_files:
            try:
                write_checkpoint(path, values, meta, streamed.specs)
            except CheckpointError as e:  # every process must still reach the agreement
                failure = e
            except OSError as e:  # every process must still reach the agreement below
                failure = CheckpointError(
                    f"Could not write the checkpoint {os.fspath(path)!r}: {e}. The previous "
                    "checkpoint files are untouched; free space or fix the folder and save "
                    "again."
                )
                failure.__cause__ = e  # raised below, outside this block: keep the OSError
            except Exception as e:
                if reads is None:  # one process: nobody waits for it
                    raise
                # In a job, anything else too: the others are waiting in the gathers and
                # then the agreement, so this process still joins both before raising.
                failure = CheckpointError(
                    f"Could not write the checkpoint {os.fspath(path)!r}: "
                    f"{type(e).__name__}: {e}. The previous checkpoint files are untouched."
                )
                failure.__cause__ = e
        if reads is not None:
            reads.finish()
        written = self._placement.agree(failure is None)
        if failure is not None:
            raise failure
        if not written:
            raise CheckpointError(
                f"Process 0 could not write the checkpoint {os.fspath(path)!r}; its error says why."
            )

    def load(self, path: str | os.PathLike[str], *, allow_other_bundle: bool = False) -> None:
        """``Trainer.load_checkpoint``."""
        # The tensors are views of the mapped file: each is copied to the devices when
        # its buffer's turn comes, and in a multi-process job each process copies only
        # its own devices' pieces of it (the digest's check has read the whole file once,
        # a tensor at a time).
        with open_checkpoint(path) as (f, meta):
            check_bundle(meta, path, self._digest, allow_other_bundle=allow_other_bundle)
            try:  # every value is checked before the state is replaced
                for k, v in meta.hyperparameters.items():
                    if k in self._hp.values:
                        self._hp.check(k, v, source=f"the checkpoint {os.fspath(path)}")
                for name, spec in meta.schedules.items():
                    if name in self._hp.values and spec is not None:
                        self._hp.check_schedule(name, spec)  # its values, not only its form
            except (BindingError, ValueError) as e:
                raise CheckpointError(f"{os.fspath(path)} cannot be restored: {e}") from None
            values = {name: f.array(name) for name in f.records}
            # Each tensor's pages dropped once its buffer is placed (one read under an
            # alias only keeps its pages until the file is closed).
            release = lambda name: f.release(name) if name in f.records else None  # noqa: E731
            self._store.put(check_state_values(self._manifest, values), after=release)
            del values
        progress = self._progress
        progress.step = meta.step
        if meta.seed is not None and progress.seed is not None:
            progress.seed = meta.seed  # checked in [0, 2**64) by the reader
        for k, v in meta.hyperparameters.items():
            if k in self._hp.values:
                self._hp.set(k, v)
        # Schedules continue: a spec is set again; a Python function cannot be stored,
        # so the next step refuses to run until the caller sets it again (or removes it),
        # rather than silently keeping its last value.
        for name, spec in meta.schedules.items():
            if name not in self._hp.values:
                continue
            if spec is not None:
                self._hp.set_schedule(name, spec)
            elif self._hp.specs.get(name, "") is not None:
                self._hp.pending.add(name)
        # What a resumed run continues: set_schedule refuses to replace it by mistake.
        self._hp.restored = {n: s for n, s in meta.schedules.items() if n in self._hp.values}
        progress.data_position = dict(meta.data) if meta.data is not None else None
