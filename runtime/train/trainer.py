"""The lean trainer: owns the training state on the device and runs a bundle's steps.

``Trainer`` is the public face of a loaded bundle, composed of parts that each own their
attributes: ``StateStore`` (the state buffers, ``state_store.py``), ``Progress`` (steps
taken, the seed, the data position, ``progress.py``), ``Hyperparameters`` (values,
device copies, schedules, ``hyper.py``), ``BatchRouter`` (every entry's shape buckets,
``batches.py``), ``Dispatcher`` (the hot path: one step or evaluation, ``dispatch.py``),
``StackedCalls`` (K steps per call, ``calls.py``), ``Runner`` (``run``'s loop,
``runs.py``) and ``Checkpoints`` (``checkpointing.py``; the file format is
``checkpoint.py``'s). The trainer's methods delegate to them.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from stepbundle.schema.manifest import Manifest

from ..compile.load_info import LoadInfo
from ..compile.state_masks import MaskPins
from ..data.evaluation import Evaluation, evaluate_dataset
from ..errors import BindingError
from ..placement.packing import Layout
from ..placement.sharding import Placement
from .batches import BatchRouter
from .calls import StackedCalls
from .checkpointing import Checkpoints
from .dispatch import Dispatcher
from .hyper import Hyperparameters
from .plan import CompiledPlan, Plan
from .progress import Progress
from .runs import Runner
from .state_store import StateStore

__all__ = ["LoadInfo", "Trainer"]


class Trainer:
    """Runs a bundle's entries on one device (or, data-parallel, on several).

    Build it with ``stepbundle.runtime.load``. State names are PyTorch's: a module's
    ``state_dict()`` keys and ``optimizer.state.<param name>.<key>``.
    """

    def __init__(
        self,
        *,
        manifest: Manifest,
        digest: str,
        placement: Placement,
        layout: Layout,
        state: list[Any],
        plans: dict[str, list[Plan]],
        hyperparameters: dict[str, float],
        seed: int | None,
        stop_on_nonfinite: bool,
        load_info: LoadInfo,
        check_state: bool = False,
        steps_per_call: int = 1,
        stacked_plans: Mapping[int, CompiledPlan] | None = None,
        refusal: str | None = None,
        pins: MaskPins | None = None,
    ) -> None:
        """``refusal``: why this trainer cannot step at all (``compile_only``), or None.
        ``pins``: the mask buffers fused programs assume (``compile/state_masks.py``)."""
        self.manifest = manifest
        self.digest = digest
        self.placement = placement
        self.device = (placement.local_devices or placement.devices)[0]
        self.devices = placement.devices
        self.load_info = load_info
        self._store = StateStore(manifest, layout, placement, state)
        self._store.broken = refusal
        self._store.pins = pins if pins is not None else MaskPins({})
        self._progress = Progress(manifest, seed)
        self._hp = Hyperparameters(manifest, hyperparameters, placement.put_replicated)
        self._router = BatchRouter(plans, placement)
        self._dispatcher = Dispatcher(
            store=self._store,
            progress=self._progress,
            hp=self._hp,
            router=self._router,
            stop_on_nonfinite=stop_on_nonfinite,
            check_state=check_state,
        )
        self._calls = StackedCalls(self._dispatcher, steps_per_call, stacked_plans or {})
        self._runner = Runner(self._dispatcher, self._calls, self._progress)
        self._checkpoints = Checkpoints(
            manifest=manifest,
            digest=digest,
            placement=placement,
            store=self._store,
            progress=self._progress,
            hp=self._hp,
        )

    def __repr__(self) -> str:
        """``<Trainer sha256:1a2b3c4d5e6f... on cpu:0, step 3, entries eval, train>``."""
        devices = f" x{len(self.devices)}" if len(self.devices) > 1 else ""
        k = f", {self.steps_per_call} steps per call" if self.steps_per_call > 1 else ""
        return (
            f"<Trainer {self.digest[:19]}... on {self.device}{devices}, step "
            f"{self.step_count}, entries {', '.join(self.entries)}{k}>"
        )

    # ------------------------------------------------------------ properties
    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self._router.plans)

    @property
    def step_count(self) -> int:
        """Number of training steps taken (restored from checkpoints)."""
        return self._progress.step

    @property
    def steps_per_call(self) -> int:
        """Steps ``run`` dispatches per call (``CompileOptions(steps_per_call=K)``); 1 by default."""
        return self._calls.k

    @property
    def seed(self) -> int | None:
        """The RNG seed the next training step receives; None when no program uses one."""
        return self._progress.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._progress.set_seed(value)

    @property
    def data_position(self) -> Any:
        """Where the data stands for the next step (a loader's ``state()``), or None."""
        return self._progress.data_position

    @data_position.setter
    def data_position(self, value: Any) -> None:
        self._progress.data_position = value

    @property
    def hyperparameters(self) -> dict[str, float]:
        """Current hyperparameter values by name."""
        return dict(self._hp.values)

    @property
    def state_names(self) -> tuple[str, ...]:
        return self._store.names

    def state_bytes_per_device(self) -> dict[str, int]:
        """Bytes of training state resident on each of this process's devices.

        Replicated state counts in full on every device; with
        ``shard_optimizer_state`` the split optimizer state counts 1/N per device.
        """
        return self._store.bytes_per_device()

    # ------------------------------------------------------- hyperparameters
    def set_hyperparameter(self, name: str, value: float) -> None:
        """Set a hyperparameter for the following steps (``lr`` sets every group's lr)."""
        self._hp.set(name, value)

    def set_schedule(
        self,
        name: str,
        schedule: Callable[[int], float] | str | None,
        *,
        replace: bool = False,
    ) -> None:
        """Set ``name`` before every training step from a schedule.

        ``schedule`` is a function of ``step`` (the number of steps taken so far, 0 for
        the first), or a spec such as ``warmup_cosine:peak=1e-3,warmup=100,total=10000``
        (see ``stepbundle.runtime.train.schedule``), which checkpoints store so a resume
        continues it. ``None`` removes the schedule.

        After ``load_checkpoint``, the trainer continues the schedules the checkpoint
        stored: another schedule for one of them (a different spec, or a Python
        function) is refused unless ``replace=True``; the same spec is taken as it is.

        Raises:
          UsageError: the spec does not parse, or the schedule would replace one the
            checkpoint restored (``schedule.refuse_clash`` says how to proceed).
          BindingError: the bundle has no such hyperparameter, or the spec's start or
            end value cannot be fed to it (not finite; an lr of 0 for capturable Adam).
        """
        self._hp.set_by_caller(name, schedule, replace=replace)

    @property
    def schedules(self) -> dict[str, str | None]:
        """The spec of each scheduled hyperparameter (None for a Python function)."""
        return dict(self._hp.specs)

    # -------------------------------------------------------------- stepping
    def step(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Run one training step on ``batch`` and return its metrics.

        The metrics are device arrays that behave like numbers (``float(m["loss"])``);
        reading one waits for the step, nothing else does.

        Raises:
          BindingError: the batch matches no shape bucket (nothing was dispatched and
            no state was consumed).
          NonFiniteLossError: with ``stop_on_nonfinite``, the loss was not finite; the
            state is the state from before the step.
        """
        self._hp.check_pending()
        plan, dev = self._dispatcher.pick("train", batch)
        return self._dispatcher.step(plan, dev)

    def run(
        self,
        batches: Iterable[Mapping[str, Any]],
        steps: int,
        on_step: Callable[[int, dict[str, Any]], object] | None = None,
        *,
        offset: int = 0,
        keep_metrics: bool = True,
    ) -> list[dict[str, Any]]:
        """Run up to ``steps`` training steps on ``batches``.

        ``batches`` is a sequence (step ``i`` uses ``batches[(offset + i) % len]``, so a
        resumed run passes its step count as ``offset``) or any iterable, such as a
        ``stepbundle.runtime.data.loader.Loader``, read until it ends. The next batch is moved
        to the device while the current step runs. If the iterable has a ``state()``
        method, ``data_position`` follows it: after each step it is the position of the
        next batch to train on, and checkpoints store it.

        ``on_step(i, metrics)`` is called after step ``i`` of this call with its (lazy)
        metrics; ``trainer.step_count`` is then the global number of steps taken. It
        may call ``request_stop()`` to end the run after this step (early stopping).
        Returns every step's metrics; for long runs pass ``keep_metrics=False`` (and read
        them in ``on_step``), which returns only the last step's, so memory stays flat.

        With ``steps_per_call`` K > 1 (``CompileOptions(steps_per_call=K)``), every K batches of
        one shape bucket run as one call; the steps and their metrics are the same,
        but the state moves K steps at a time: ``on_step`` is called for each of a
        call's K steps after the call, and sees ``step_count``, the state (and
        checkpoints it saves) and ``data_position`` as they are at the end of the call.
        ``request_stop()`` ends the run after the current call. Calls start at
        multiples of K steps (``step_count``); steps before the first multiple (a
        resumed run), and batches that do not fill a call of one bucket (the last ones,
        a short last batch), run one step at a time. A batch no bucket takes is
        refused after the steps before it ran.
        """
        return self._runner.run(batches, steps, on_step, offset, keep_metrics)

    def request_stop(self) -> None:
        """End the ``run`` in progress after the current step (call it from ``on_step``)."""
        self._runner.stop_requested = True

    def step_many(self, batches: Mapping[str, Any]) -> dict[str, Any]:
        """Run K training steps (K = ``steps_per_call``) in one call on a stack of batches.

        ``batches`` maps every batch input to an array with a leading axis of K: row
        ``i`` is step ``i``'s batch, all of one shape bucket. Returns every metric
        stacked the same way (``metrics["loss"][i]`` is step ``i``'s loss). The result
        is bit for bit that of K calls of ``step``.

        Raises:
          BatchStackError: the trainer runs one step per call, or the stack's arrays do
            not have K rows of one bucket's shapes (nothing was dispatched).
          NonFiniteLossError: with ``stop_on_nonfinite``, a step's loss was not finite;
            the state is the state from before that step (the call is replayed one
            step at a time up to it).
        """
        return self._calls.step_many(batches)

    def evaluate(self, batch: Mapping[str, Any], entry: str = "eval") -> dict[str, Any]:
        """Run a read-only entry on the current state. Nothing is donated or changed.

        Raises:
          BindingError: ``entry`` updates state (such as ``"train"``): run it with
            ``step``, which takes its results back; ``evaluate`` would lose the state.
        """
        found = self.manifest.entries.get(entry)
        if found is not None and found.updates_state:
            read_only = [n for n, e in self.manifest.entries.items() if not e.updates_state]
            raise BindingError(
                f"evaluate() runs read-only entries, and {entry!r} updates the state: its "
                "state buffers would be donated and lost. Use step() to train, or evaluate "
                f"one of the read-only entries: {', '.join(map(repr, read_only)) or 'none'}."
            )
        plan, dev = self._dispatcher.pick(entry, batch)
        return self._dispatcher.evaluate(plan, dev)

    def evaluate_dataset(
        self,
        batches: Iterable[Mapping[str, Any]],
        entry: str = "eval",
        *,
        mask_key: str | None = None,
    ) -> Evaluation:
        """Each scalar metric of ``entry`` averaged over every real row of ``batches``
        (a padded last batch masked); see ``stepbundle.runtime.data.evaluation``."""
        return evaluate_dataset(self, batches, entry=entry, mask_key=mask_key)

    # ----------------------------------------------------------------- state
    def state_dict(
        self, *, include_aliases: bool = True, copy: bool = True
    ) -> dict[str, np.ndarray[Any, Any]]:
        """The current state as numpy arrays (copies), under PyTorch's names.

        Tied weights appear under each of their names, as in ``module.state_dict()``.
        ``copy=False`` skips the copy where a buffer already lies in this process's
        memory (a CPU device): those arrays are read-only views of the device buffers
        (each keeps its buffer alive), for reading the state once right away, before
        the next step (the export check's child writes it so); the rest are copies.
        """
        return self._store.state_dict(include_aliases=include_aliases, copy=copy)

    def load_state_dict(self, values: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """Replace the state with ``values`` (every state name, exact dtypes and shapes)."""
        self._store.load(values)

    def block_until_ready(self) -> None:
        """Wait until every dispatched step has finished."""
        self._store.block_until_ready()

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
        self._checkpoints.save(path)

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
          CheckpointError: also when the checkpoint's format is unknown to this version.
          OtherBundleError: another bundle wrote it and ``allow_other_bundle`` is False.
          CheckpointError: the file is damaged, or its state does not match.
        """
        self._checkpoints.load(path, allow_other_bundle=allow_other_bundle)
