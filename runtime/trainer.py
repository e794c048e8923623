"""The lean trainer: owns the training state on the device and runs a bundle's steps.

The hot path (``Trainer.step``) does only what a step needs: check the batch against
the plans (before anything is dispatched, so a rejected call donates nothing), move
the batch to the device, assemble the argument list from the plan's precomputed slots,
execute asynchronously, and swap the donated state buffers for their updates. Metrics
come back as device arrays; reading one (``float(m["loss"])``) is what waits for the
step. State access and checkpoints (which state, which metadata, the agreement of a
multi-process job) are ``checkpointing.py``'s part of the class, K steps per call
(``step_many`` and ``run``'s grouped dispatch) ``calls.py``'s; the checkpoint file
format is ``checkpoint.py``'s.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from stepbundle.schema.manifest import Manifest
from stepbundle.schema.rng import TORCH_XLA_MARK_STEP, advance_seed

from . import _compat
from .calls import StepCalls
from .checkpointing import StateAndCheckpoints
from .errors import BindingError, DeviceError
from .evaluation import Evaluation, evaluate_dataset
from .hyper import Hyperparameters
from .load_info import LoadInfo
from .packing import Layout
from .plan import CompiledPlan, Plan
from .sharding import Placement
from .watch import check_step

__all__ = ["LoadInfo", "Trainer"]

_END: Any = object()  # what next() returns from an exhausted batch iterator

_U64 = 2**64


class Trainer(StateAndCheckpoints, StepCalls):
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
    ) -> None:
        self.manifest = manifest
        self.digest = digest
        self.placement = placement
        self.device = (placement.local_devices or placement.devices)[0]
        self.devices = placement.devices
        self.load_info = load_info
        self._names = [e.name for e in manifest.state]
        self._aliases = {e.name: e.aliases for e in manifest.state}
        # The device buffers, one per entry of the layout: a state tensor held on its
        # own, or a pack of small ones (see packing.py).
        self._layout = layout
        self._state = state
        self._plans = plans
        self._hp = Hyperparameters(manifest, hyperparameters, placement.put_replicated)
        # The hot path reads these directly: the same objects as self._hp's.
        self._hyper = self._hp.values
        self._hyper_bufs = self._hp.buffers
        self._schedules = self._hp.schedules
        self._hyper_buf = self._hp.buffer
        self._seed = seed
        # The seed advances by the rule the bundle names; an unknown rule fails here,
        # at load, rather than at the first step.
        self._seed_rule = manifest.rng.rule if manifest.rng is not None else TORCH_XLA_MARK_STEP
        # A step that restored torch_xla's RNG state mid-step advances from the seed N
        # draws on (Rng.step_after_draws).
        self._seed_draws = manifest.rng.step_after_draws if manifest.rng is not None else 0
        if seed is not None:
            advance_seed(self._seed_rule, seed, 0)
        self._step = 0
        self._put_scalar = placement.put_replicated
        self._stop_on_nonfinite = stop_on_nonfinite
        self._check_state = check_state
        self._broken: str | None = None
        self._stop_requested = False
        self._pending_schedules: set[str] = set()
        self.data_position: Any = None
        """Where the data stands for the next step (a loader's ``state()``), or None."""
        # K steps per call (multistep.py): the train buckets' K-step plans, by bucket.
        self._k = steps_per_call
        self._stacked_plans = dict(stacked_plans or {})

    # ------------------------------------------------------------ properties
    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self._plans)

    @property
    def step_count(self) -> int:
        """Number of training steps taken (restored from checkpoints)."""
        return self._step

    @property
    def steps_per_call(self) -> int:
        """Steps ``run`` dispatches per call (``load(steps_per_call=K)``); 1 by default."""
        return self._k

    @property
    def seed(self) -> int | None:
        """The RNG seed the next training step receives; None when no program uses one."""
        return self._seed

    @seed.setter
    def seed(self, value: int) -> None:
        if self._seed is None:
            raise BindingError(
                "This bundle's programs use no random numbers, so it has no seed to set."
            )
        if not isinstance(value, int) or not 0 <= value < _U64:
            raise BindingError(f"The seed must be an integer in [0, 2**64), got {value!r}.")
        self._seed = value

    @property
    def hyperparameters(self) -> dict[str, float]:
        """Current hyperparameter values by name."""
        return dict(self._hyper)

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(self._names)

    def state_bytes_per_device(self) -> dict[str, int]:
        """Bytes of training state resident on each of this process's devices.

        Replicated state counts in full on every device; with
        ``shard_optimizer_state`` the split optimizer state counts 1/N per device.
        """
        return self.placement.bytes_per_device(self._state)

    # ------------------------------------------------------- hyperparameters
    def set_hyperparameter(self, name: str, value: float) -> None:
        """Set a hyperparameter for the following steps (``lr`` sets every group's lr)."""
        self._hp.set(name, value)

    def set_schedule(self, name: str, schedule: Callable[[int], float] | str | None) -> None:
        """Set ``name`` before every training step from a schedule.

        ``schedule`` is a function of ``step`` (the number of steps taken so far, 0 for
        the first), or a spec such as ``warmup_cosine:peak=1e-3,warmup=100,total=10000``
        (see ``stepbundle.runtime.schedule``), which checkpoints store so a resume
        continues it. ``None`` removes the schedule.
        """
        self._hp.set_schedule(name, schedule)
        self._pending_schedules.difference_update(self._hp.resolve(name))

    @property
    def schedules(self) -> dict[str, str | None]:
        """The spec of each scheduled hyperparameter (None for a Python function)."""
        return dict(self._hp.specs)

    def _check_schedules_set(self) -> None:
        if self._pending_schedules:
            names = ", ".join(sorted(self._pending_schedules))
            raise BindingError(
                f"The checkpoint was saved while {names} followed a Python schedule, which "
                "checkpoints cannot store. Call set_schedule(name, fn) again before "
                "stepping (or set_schedule(name, None) to keep the checkpoint's value)."
            )

    # -------------------------------------------------------------- stepping
    def _args(
        self, plan: CompiledPlan, dev_batch: Mapping[str, Any], seed: int | None
    ) -> list[Any]:
        args = plan.arguments(self._state, dev_batch)
        if plan.seed_slot is not None:
            assert seed is not None
            args[plan.seed_slot] = self._put_scalar(np.array(seed, dtype=np.uint64).view(np.int64))
        for pos, name in plan.hyper_slots:
            args[pos] = self._hyper_buf(name)
        return args

    def _dispatch(self, plan: CompiledPlan, dev_batch: Mapping[str, Any]) -> dict[str, Any]:
        if self._schedules:
            for name, fn in self._schedules.items():
                v = float(fn(self._step))
                if self._hyper[name] != v:
                    # Checked before dispatch: nothing has been donated yet.
                    self._hp.check(name, v, source=f"the schedule of {name!r} at step {self._step}")
                    self._hyper[name] = v
                    self._hyper_bufs.pop(name, None)
        args = self._args(plan, dev_batch, self._seed)
        try:
            outs = plan.dispatch(args)
        except _compat.JaxRuntimeError as e:
            raise self._device_error(plan, e) from e
        metrics = {name: outs[pos] for pos, name in plan.metric_slots}
        if self._stop_on_nonfinite:
            # Compiled without donation: on a refusal the old state is intact.
            check_step(
                self._step,
                metrics,
                [outs[pos] for pos, _ in plan.update_slots] if self._check_state else None,
            )
        st = self._state
        for pos, si in plan.update_slots:
            st[si] = outs[pos]
        self._step += 1
        if self._seed is not None:
            self._seed = advance_seed(self._seed_rule, self._seed, 1, self._seed_draws)
        return metrics

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
        self._check_schedules_set()
        plan, dev = self._pick("train", batch)
        return self._dispatch(plan, dev)

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
        ``stepbundle.runtime.loader.Loader``, read until it ends. The next batch is moved
        to the device while the current step runs. If the iterable has a ``state()``
        method, ``data_position`` follows it: after each step it is the position of the
        next batch to train on, and checkpoints store it.

        ``on_step(i, metrics)`` is called after step ``i`` of this call with its (lazy)
        metrics; ``trainer.step_count`` is then the global number of steps taken. It
        may call ``request_stop()`` to end the run after this step (early stopping).
        Returns every step's metrics; for long runs pass ``keep_metrics=False`` (and read
        them in ``on_step``), which returns only the last step's, so memory stays flat.

        With ``steps_per_call`` K > 1 (``load(steps_per_call=K)``), every K batches of
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
        out: list[dict[str, Any]] = []
        self._stop_requested = False
        self._check_schedules_set()
        if isinstance(batches, Sequence):
            if not batches:
                raise BindingError("run() needs at least one batch.")
            n = len(batches)
            source: Iterator[Mapping[str, Any]] = (batches[(offset + i) % n] for i in range(steps))
            position: Callable[[], Any] | None = None
        else:
            source = iter(batches)
            position = getattr(source, "state", None)
        # A loader of one process's rows in a multi-process job (process_count > 1).
        local = getattr(batches, "process_count", 1) > 1
        if steps <= 0:
            return out
        if position is not None:
            self.data_position = position()
        if self._k > 1:
            return self._run_calls(source, steps, on_step, position, local, keep_metrics)
        first = next(source, _END)
        if first is _END:
            return out
        nxt = self._pick("train", first, local)
        failed: BindingError | None = None
        for i in range(steps):
            plan, dev = nxt
            metrics = self._dispatch(plan, dev)
            more = i + 1 < steps
            if position is not None:
                self.data_position = position()  # the batch after this step's
            if more:
                # Dispatch was asynchronous: this transfer overlaps the running step.
                try:
                    following = next(source, _END)
                    more = following is not _END
                    if more:
                        nxt = self._pick("train", following, local)
                except BindingError as e:
                    # A batch the data cannot give (a shard truncated under the run) or
                    # no bucket takes: this step ran, so it is reported before the error.
                    failed, more = e, False
            if on_step is not None:
                on_step(i, metrics)
            if keep_metrics or not more or self._stop_requested:
                out.append(metrics)
            if not more or self._stop_requested:
                break
        if failed is not None:
            raise failed
        return out

    # ------------------------------------------------- K steps per call
    def request_stop(self) -> None:
        """End the ``run`` in progress after the current step (call it from ``on_step``)."""
        self._stop_requested = True

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
        plan, dev = self._pick(entry, batch)
        if self._broken is not None:
            raise BindingError(self._broken)
        args = self._args(plan, dev, None)
        try:
            outs = plan.dispatch(args)
        except _compat.JaxRuntimeError as e:
            raise self._device_error(plan, e) from e
        return {name: outs[pos] for pos, name in plan.metric_slots}

    def _device_error(self, plan: CompiledPlan, e: Exception) -> DeviceError:
        """The error for a failure inside XLA or the device (the arguments were checked
        before the call); a program that donated marks the trainer broken."""
        if plan.compiled.donating:
            self._broken = (
                f"A step failed inside the device runtime ({e}); its donated state "
                "buffers may be gone. Load a checkpoint (trainer.load_checkpoint) or "
                "the bundle again to continue."
            )
            return DeviceError(self._broken)
        return DeviceError(
            f"A step failed inside the device runtime ({e}); it donated nothing, so the "
            "state is as it was before the step."
        )

    def evaluate_dataset(
        self,
        batches: Iterable[Mapping[str, Any]],
        entry: str = "eval",
        *,
        mask_key: str | None = None,
    ) -> Evaluation:
        """Each scalar metric of ``entry`` averaged over every real row of ``batches``
        (a padded last batch masked); see ``stepbundle.runtime.evaluation``."""
        return evaluate_dataset(self, batches, entry=entry, mask_key=mask_key)
