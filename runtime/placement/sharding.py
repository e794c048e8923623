"""Where the trainer's arrays live: one device, or a data-parallel mesh of several.

Data parallelism needs no re-export. The single-device step is compiled for N devices
with Shardy annotations on ``@main``: every batch input of rank >= 1 is split on its
first dimension over a one-axis mesh (``data``), everything else is replicated, and
every result is replicated. XLA's SPMD partitioner then runs each device on its slice
of the global batch and inserts the collectives (the gradient all-reduce, and the
reductions of the loss and of BatchNorm statistics over the whole batch) itself. The
computation is the one-device step on the global batch, up to the order of floating
point sums.

With ``shard_optimizer_state`` (ZeRO stage 1), optimizer-state tensors whose first
dimension divides evenly are split over the mesh as well: each device keeps and
updates 1/N of them, and the partitioner gathers the parameter updates.

Imports: numpy, jax, stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as _PartitionSpec

from stepbundle.schema.manifest import (
    BatchInput,
    Manifest,
    Program,
    StateInput,
    StateKind,
    StateUpdateOutput,
)

from .. import _compat
from .packing import Layout

__all__ = ["AXIS", "MESH", "Placement"]

PartitionSpec: Any = _PartitionSpec  # untyped in jax's stubs

AXIS = "data"
MESH = "stepbundle_mesh"


def _sdy(rank: int, split: bool, dim: int = 0) -> str:
    dims = ["{}"] * rank
    if split:
        dims[dim] = '{"' + AXIS + '"}'
    return f"#sdy.sharding<@{MESH}, [{', '.join(dims)}]>"


class Placement:
    """The devices a trainer runs on, and the sharding of every array it passes.

    ``split_state`` names the state buffers (layout buffer names) that are split on
    their first dimension rather than replicated (ZeRO-1 optimizer state).
    """

    def __init__(self, devices: Sequence[Any], split_state: frozenset[str] = frozenset()) -> None:
        self.devices = tuple(devices)
        self.n = len(self.devices)
        self.split_state = split_state
        if self.n == 1:
            self.replicated: Any = _compat.single_device_sharding(self.devices[0])
            self.split: Any = self.replicated
            self.split_stacked: Any = self.replicated
        else:
            mesh = Mesh(np.array(self.devices, dtype=object), (AXIS,))
            self.replicated = NamedSharding(mesh, PartitionSpec())
            self.split = NamedSharding(mesh, PartitionSpec(AXIS))
            # A stack of K batches (steps_per_call): the rows are its second dimension.
            self.split_stacked = NamedSharding(mesh, PartitionSpec(None, AXIS))
        me = jax.process_index()
        # This process's own devices (all of them, outside a multi-process job).
        self.local_devices = tuple(d for d in self.devices if d.process_index == me)
        processes = {d.process_index for d in self.devices}
        self.process_count = len(processes)
        # In a multi-process job one process writes the files everyone would write.
        self.writes_files = me == min(processes)

    @property
    def partitioned(self) -> bool:
        return self.n > 1

    # ---------------------------------------------------------- annotations
    def _splits_input(self, row: Any, stacked: bool = False) -> bool:
        if isinstance(row, BatchInput):
            return len(row.spec.shape) >= (2 if stacked else 1)
        return isinstance(row, StateInput) and row.name in self.split_state

    def _splits_output(self, row: Any) -> bool:
        return isinstance(row, StateUpdateOutput) and row.state in self.split_state

    def annotations(self, program: Program, stacked: bool = False) -> tuple[list[str], list[str]]:
        """Shardy shardings of the program's arguments and results, as MLIR text.

        ``stacked``: the program takes stacks of K batches (``multistep.py``), whose
        rows are their second dimension.
        """
        args = [
            _sdy(
                len(r.spec.shape),
                self._splits_input(r, stacked),
                1 if stacked and isinstance(r, BatchInput) else 0,
            )
            for r in program.inputs
        ]
        results = [_sdy(len(r.spec.shape), self._splits_output(r)) for r in program.outputs]
        return args, results

    def output_shardings(self, program: Program) -> list[Any]:
        return [self.split if self._splits_output(r) else self.replicated for r in program.outputs]

    def usable_buckets(self, programs: Sequence[Program]) -> list[Program]:
        """The shape buckets whose batches split evenly over the devices."""
        return [p for p in programs if self.indivisible(p) is None]

    def indivisible(self, program: Program) -> str | None:
        """Why this shape bucket cannot run on the mesh, or None when it can."""
        if self.n == 1:
            return None
        for b in program.batch:
            if b.spec.shape and b.spec.shape[0] % self.n:
                return (
                    f"batch input {b.name!r} has {b.spec.shape[0]} rows in this bucket, "
                    f"which do not split evenly over {self.n} devices"
                )
        return None

    # ------------------------------------------------------------- transfers
    def put_replicated(self, x: np.ndarray[Any, Any]) -> Any:
        return _compat.put_sharded(x, self.replicated)

    def put_batch(self, x: np.ndarray[Any, Any]) -> Any:
        """A global batch array: split on dim 0 (replicated when it is a scalar)."""
        return _compat.put_sharded(x, self.split if x.ndim >= 1 else self.replicated)

    def put_stacked_batch(self, x: np.ndarray[Any, Any]) -> Any:
        """A stack of K global batch arrays: split on dim 1 (replicated below rank 2)."""
        return _compat.put_sharded(x, self.split_stacked if x.ndim >= 2 else self.replicated)

    def put_local_batch(self, x: np.ndarray[Any, Any]) -> Any:
        """This process's rows of a global batch: the global array is assembled from every
        process's rows, in process order (each process reads only its own data)."""
        if x.ndim == 0 or self.process_count == 1:
            return self.put_batch(x)
        shape = (x.shape[0] * self.process_count, *x.shape[1:])
        return _compat.from_process_local(self.split, x, shape)

    def put_state(self, name: str, x: np.ndarray[Any, Any]) -> Any:
        if name in self.split_state:
            return _compat.put_sharded(x, self.split)
        return _compat.put_sharded(x, self.replicated)

    def holds(self, a: Any, split: bool) -> bool:
        """Whether device array ``a`` already has the sharding a batch input needs."""
        sharding = getattr(a, "sharding", None)
        if sharding is None:
            return False
        want = self.split if split else self.replicated  # the same on one device
        try:
            return bool(sharding.is_equivalent_to(want, a.ndim))
        # A sharding jax cannot compare with ours (another kind, a rank its spec does not
        # fit) is not ours: the batch is copied instead.
        except (ValueError, TypeError, NotImplementedError, AttributeError):
            return False

    def agree(self, ok: bool) -> bool:
        """Whether every process of a multi-process run passed ``ok`` (it waits for
        all of them); ``ok`` otherwise."""
        if self.process_count > 1:
            from .distributed import agree

            return agree(ok)
        return ok

    def bytes_per_device(self, buffers: Sequence[Any]) -> dict[str, int]:
        """Bytes of ``buffers`` resident on each of this process's devices."""
        out: dict[str, int] = {}
        for buf in buffers:
            for shard in buf.addressable_shards:
                key = f"{shard.device.platform}:{shard.device.id}"
                out[key] = out.get(key, 0) + int(shard.data.nbytes)
        return out


def zero1_split(manifest: Manifest, layout: Layout, n: int) -> frozenset[str]:
    """The state buffers ZeRO-1 splits over ``n`` devices: optimizer state held on its
    own (not packed) whose first dimension is a multiple of ``n``."""
    kinds = {s.name: s for s in manifest.state}
    out = set()
    for buf in layout.buffers:
        if not isinstance(buf, str):
            continue
        entry = kinds[buf]
        shape = entry.spec.shape
        if entry.kind == StateKind.OPTIMIZER_STATE and shape and shape[0] % n == 0:
            out.add(buf)
    return frozenset(out)
