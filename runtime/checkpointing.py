"""The trainer's state as a whole: read it, replace it, save it to and restore it from
checkpoints (``Trainer`` inherits these methods from ``StateAndCheckpoints``).

What goes into a checkpoint (state under PyTorch's names, step count, seed,
hyperparameters, schedule specs, the data position) and the agreement of a
multi-process job (every process gathers, process 0 writes, all learn whether the file
is in place) are decided here; the file format is ``checkpoint.py``'s.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from stepbundle.schema.manifest import Manifest

from . import _compat
from .checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointMeta,
    check_bundle,
    read_checkpoint,
    write_checkpoint,
)
from .errors import BindingError, CheckpointError
from .hyper import Hyperparameters
from .packing import Layout
from .sharding import Placement
from .state import check_state_values, host_buffers, named_values

__all__ = ["StateAndCheckpoints"]


class StateAndCheckpoints:
    """State access and checkpoints of a ``Trainer`` (which sets every attribute below)."""

    manifest: Manifest
    digest: str
    placement: Placement
    data_position: Any
    _layout: Layout
    _state: list[Any]
    _names: Sequence[str]
    _aliases: Mapping[str, tuple[str, ...]]
    _broken: str | None
    _step: int
    _seed: int | None
    _hyper: dict[str, float]
    _hp: Hyperparameters
    _pending_schedules: set[str]

    # ----------------------------------------------------------------- state
    def state_dict(self, *, include_aliases: bool = True) -> dict[str, np.ndarray[Any, Any]]:
        """The current state as numpy arrays (copies), under PyTorch's names.

        Tied weights appear under each of their names, as in ``module.state_dict()``.
        """
        if self._broken is not None:
            raise BindingError(self._broken)
        # One transfer per buffer, each when its turn comes.
        values = named_values(self._layout, (_compat.to_host(b) for b in self._state))
        out: dict[str, np.ndarray[Any, Any]] = {}
        for name in self._names:
            out[name] = values[name]
            if include_aliases:
                for alias in self._aliases.get(name, ()):
                    out[alias] = values[name]
        return out

    def load_state_dict(self, values: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """Replace the state with ``values`` (every state name, exact dtypes and shapes)."""
        self._put_state(check_state_values(self.manifest, values))

    def _put_state(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """Replace the state with ``arrays``, already checked against the state table."""
        self._state = [
            self.placement.put_state(name, a)
            for name, a in zip(self._layout.buffer_names, host_buffers(self._layout, arrays))
        ]
        self._broken = None

    def block_until_ready(self) -> None:
        """Wait until every dispatched step has finished."""
        _compat.block(self._state)

    # ----------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write the state, step count, RNG seed and hyperparameters atomically.

        The file is safetensors with PyTorch's state names; the step count, seed and
        hyperparameters sit in its metadata (``stepbundle`` key, JSON), so the write is
        one atomic rename. In a multi-process job every process calls this: all take
        part in gathering the state, process 0 writes the file, and every process
        returns (or raises) once it says whether the file is in place.

        Raises:
          CheckpointError: the file could not be written (on every process of a job);
            the previous file at ``path`` is untouched.
        """
        meta = CheckpointMeta(
            format=CHECKPOINT_FORMAT,
            step=self._step,
            seed=self._seed,
            hyperparameters=dict(self._hyper),
            bundle_digest=self.digest,
            schedules=dict(self._hp.specs),
            data=self.data_position,
        )
        values = self.state_dict(include_aliases=True)
        failure: CheckpointError | None = None
        if self.placement.writes_files:
            try:
                write_checkpoint(path, values, meta)
            except CheckpointError as e:  # every process must still reach the agreement
                failure = e
            except OSError as e:  # every process must still reach the agreement below
                failure = CheckpointError(
                    f"Could not write the checkpoint {os.fspath(path)!r}: {e}. The previous "
                    "checkpoint files are untouched; free space or fix the folder and save "
                    "again."
                )
        written = self.placement.agree(failure is None)
        if failure is not None:
            raise failure
        if not written:
            raise CheckpointError(
                f"Process 0 could not write the checkpoint {os.fspath(path)!r}; its error says why."
            )

    def load_checkpoint(
        self, path: str | os.PathLike[str], *, allow_other_bundle: bool = False
    ) -> None:
        """Restore state, step count, seed and hyperparameters exactly.

        Everything is checked before anything changes: a refused checkpoint leaves the
        trainer as it was.

        Args:
          path: a checkpoint written by ``save_checkpoint``.
          allow_other_bundle: restore a checkpoint written by another bundle (another
            digest) whose state still matches this bundle's state table, e.g. the same
            model re-exported.

        Raises:
          CheckpointFormatError: the checkpoint's format is unknown to this version.
          OtherBundleError: another bundle wrote it and ``allow_other_bundle`` is False.
          CheckpointError: the file is damaged, or its state does not match.
        """
        values, meta = read_checkpoint(path)
        check_bundle(meta, path, self.digest, allow_other_bundle=allow_other_bundle)
        try:  # every value is checked before the state is replaced
            for k, v in meta.hyperparameters.items():
                if k in self._hyper:
                    self._hp.check(k, v, source=f"the checkpoint {os.fspath(path)}")
            for name, spec in meta.schedules.items():
                if name in self._hyper and spec is not None:
                    self._hp.check_schedule(name, spec)  # its values too, not only its form
        except (BindingError, ValueError) as e:
            raise CheckpointError(f"{os.fspath(path)} cannot be restored: {e}") from None
        self._put_state(check_state_values(self.manifest, values))
        self._step = meta.step
        if meta.seed is not None and self._seed is not None:
            self._seed = meta.seed  # checked in [0, 2**64) by the reader
        for k, v in meta.hyperparameters.items():
            if k in self._hyper:
                self._hp.set(k, v)
        # Schedules continue: a spec is set again; a Python function cannot be stored,
        # so the next step refuses to run until the caller sets it again (or removes it),
        # rather than silently keeping its last value.
        for name, spec in meta.schedules.items():
            if name not in self._hyper:
                continue
            if spec is not None:
                self._hp.set_schedule(name, spec)
            elif self._hp.specs.get(name, "") is not None:
                self._pending_schedules.add(name)
        self.data_position = dict(meta.data) if meta.data is not None else None
