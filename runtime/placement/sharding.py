"""Where the trainer's arrays live: one device, or a mesh of several.

Data parallelism needs no re-export. The single-device step is compiled for N devices
with Shardy annotations on ``@main``: every batch input of rank >= 1 is split on its
first dimension over the mesh's ``data`` axis, every metric is replicated, and each
state tensor is split as the layout's ``ShardPlan`` says (``shard_plan.py``: nothing for
``dp``, optimizer state for ZeRO-1, parameters and optimizer state for FSDP, large
matmul weights over a ``model`` axis with ``+tp``), its update the same way; the batch's
split propagates first (``BATCH_PRIORITY``), the state's after it. XLA's SPMD
partitioner then runs each device on its slice of the global batch and of the state and
inserts the collectives (the gradient all-reduce or reduce-scatter, the gathers of split
parameters, the reductions of the loss and of BatchNorm statistics over the whole
batch) itself. The computation is the one-device step on the global batch, up to the
order of floating point sums.

Imports: numpy, jax, stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as _PartitionSpec

from stepbundle.schema.manifest import BatchInput, Program, StateInput, StateUpdateOutput

from .. import _compat
from .shard_plan import DATA, MODEL, ShardPlan

__all__ = ["AXIS", "MESH", "MODEL", "Placement"]

PartitionSpec: Any = _PartitionSpec  # untyped in jax's stubs

AXIS = DATA
MESH = "stepbundle_mesh"


BATCH_PRIORITY = 0
"""The propagation priority of the batch's split: Shardy's ``p0``, propagated first."""
STATE_PRIORITY = 1
"""The propagation priority of the state's splits (``p1``), after the batch's. Where a
weight's ``data`` split (FSDP) and the batch's meet on one product, the activations
keep the batch's split and the partitioner gathers the weight. At one priority, Shardy
gave the activations of a 2-D mesh (``fsdp+tp``) the weights' split and gathered the
whole global batch onto every device (#41; docs/parallel.md has the figures)."""


def _sdy(dims: Sequence[str | None], priority: int | None = None) -> str:
    """A Shardy sharding on the mesh: one axis (or none) per dimension, as MLIR text;
    ``priority`` marks each split dimension's propagation priority (``p0`` first)."""
    mark = "" if priority is None else f"p{priority}"
    text = ", ".join("{}" if a is None else '{"' + a + '"}' + mark for a in dims)
    return f"#sdy.sharding<@{MESH}, [{text}]>"


class Placement:
    """The devices a trainer runs on, and the sharding of every array it passes.

    ``plan`` says which state buffers (layout buffer names) are split, on which
    dimension, over which mesh axis (``ShardPlan``); None: all replicated over a 1-D
    ``data`` mesh.
    """

    def __init__(self, devices: Sequence[Any], plan: ShardPlan | None = None) -> None:
        self.devices = tuple(devices)
        self.n = len(self.devices)
        self.plan = plan
        self.state_dims: Mapping[str, tuple[str | None, ...]] = plan.dims if plan else {}
        self.split_state = frozenset(self.state_dims)
        self.model = plan.model if plan is not None else 1
        self.data = self.n // self.model  # devices on the data axis: the batch's split
        self.layout = plan.layout.spec if plan is not None else "dp"
        self._state_shardings: dict[tuple[str | None, ...], Any] = {}
        if self.n == 1:
            self.mesh: Any = None
            self.replicated: Any = _compat.single_device_sharding(self.devices[0])
            self.split: Any = self.replicated
            self.split_stacked: Any = self.replicated
        else:
            if self.model > 1:
                grid = np.array(self.devices, dtype=object).reshape(self.data, self.model)
                self.mesh = Mesh(grid, (AXIS, MODEL))
            else:
                self.mesh = Mesh(np.array(self.devices, dtype=object), (AXIS,))
            self.replicated = NamedSharding(self.mesh, PartitionSpec())
            self.split = NamedSharding(self.mesh, PartitionSpec(AXIS))
            # A stack of K batches (steps_per_call): the rows are its second dimension.
            self.split_stacked = NamedSharding(self.mesh, PartitionSpec(None, AXIS))
        me = jax.process_index()
        # This process's own devices (all of them, outside a multi-process job).
        self.local_devices = tuple(d for d in self.devices if d.process_index == me)
        processes = {d.process_index for d in self.devices}
        self.process_count = len(processes)
        # In a multi-process job one process writes the files everyone would write.
        self.writes_files = me == min(processes)

    @property
    def mesh_axes(self) -> list[tuple[str, int]]:
        """The mesh's axes and sizes, as the module declares them."""
        return [(AXIS, self.data)] + ([(MODEL, self.model)] if self.model > 1 else [])

    def state_sharding(self, name: str) -> Any:
        """The sharding of state buffer ``name`` (replicated unless the plan splits it)."""
        dims = self.state_dims.get(name)
        if dims is None or self.mesh is None:
            return self.replicated
        sharding = self._state_shardings.get(dims)
        if sharding is None:
            sharding = NamedSharding(self.mesh, PartitionSpec(*dims))
            self._state_shardings[dims] = sharding
        return sharding

    @property
    def partitioned(self) -> bool:
        return self.n > 1

    # ---------------------------------------------------------- annotations
    def _input_dims(self, row: Any, stacked: bool = False) -> list[str | None]:
        rank = len(row.spec.shape)
        dims: list[str | None] = [None] * rank
        if isinstance(row, BatchInput):
            if rank >= (2 if stacked else 1):
                dims[1 if stacked else 0] = AXIS
        elif isinstance(row, StateInput) and row.name in self.state_dims:
            dims = list(self.state_dims[row.name])
        return dims

    def _output_dims(self, row: Any) -> list[str | None]:
        if isinstance(row, StateUpdateOutput) and row.state in self.state_dims:
            return list(self.state_dims[row.state])
        return [None] * len(row.spec.shape)

    def annotations(self, program: Program, stacked: bool = False) -> tuple[list[str], list[str]]:
        """Shardy shardings of the program's arguments and results, as MLIR text.

        ``stacked``: the program takes stacks of K batches (``multistep.py``), whose
        rows are their second dimension.
        """
        args = [
            _sdy(
                self._input_dims(r, stacked),
                BATCH_PRIORITY if isinstance(r, BatchInput) else STATE_PRIORITY,
            )
            for r in program.inputs
        ]
        results = [_sdy(self._output_dims(r), STATE_PRIORITY) for r in program.outputs]
        return args, results

    def output_shardings(self, program: Program) -> list[Any]:
        return [
            self.state_sharding(r.state) if isinstance(r, StateUpdateOutput) else self.replicated
            for r in program.outputs
        ]

    def usable_buckets(self, programs: Sequence[Program]) -> list[Program]:
        """The shape buckets whose batches split evenly over the devices."""
        return [p for p in programs if self.indivisible(p) is None]

    def indivisible(self, program: Program) -> str | None:
        """Why this shape bucket cannot run on the mesh, or None when it can."""
        if self.data == 1:
            return None
        for b in program.batch:
            if b.spec.shape and b.spec.shape[0] % self.data:
                where = (
                    f"the {self.data} devices of the data axis"
                    if self.model > 1
                    else f"{self.n} devices"
                )
                return (
                    f"batch input {b.name!r} has {b.spec.shape[0]} rows in this bucket, "
                    f"which do not split evenly over {where}"
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
        return _compat.put_sharded(x, self.state_sharding(name))

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
