"""The hot path: one step of a plan on the current state, and a read-only evaluation.

``Dispatcher`` is the trainer's part that runs plans. It does only what a step needs:
check the batch against the plans (before anything is dispatched, so a rejected call
donates nothing), move the batch to the device, assemble the argument list from the
plan's precomputed slots, execute asynchronously, and swap the donated state buffers for
their updates. Metrics come back as device arrays; reading one (``float(m["loss"])``)
is what waits for the step. It works on the other parts (the state, the progress, the
hyperparameters, the plans) and owns only what a dispatch decides: whether to stop on
non-finite values, and how a failure inside the device is reported.

Imports: numpy, jax/jaxlib (through _compat).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import _compat
from ..errors import DeviceError
from .batches import BatchRouter
from .hyper import Hyperparameters
from .plan import CompiledPlan, Plan
from .progress import Progress
from .state_store import StateStore
from .watch import check_step

__all__ = ["Dispatcher"]


class Dispatcher:
    """Runs one plan on the state: a training step, or a read-only evaluation.

    Attributes:
      stop_on_nonfinite: refuse a step whose metrics are not finite (the programs were
        compiled without donation, so the old state is intact on a refusal).
      check_state: with ``stop_on_nonfinite``, also refuse a step whose new state is not.
    """

    def __init__(
        self,
        *,
        store: StateStore,
        progress: Progress,
        hp: Hyperparameters,
        router: BatchRouter,
        stop_on_nonfinite: bool,
        check_state: bool,
    ) -> None:
        self.store = store
        self.progress = progress
        self.hp = hp
        self.router = router
        self.stop_on_nonfinite = stop_on_nonfinite
        self.check_state = check_state
        self._put_scalar = router.placement.put_replicated

    # ------------------------------------------------------------- batches
    def pick(
        self, entry: str, batch: Mapping[str, Any], local: bool = False
    ) -> tuple[CompiledPlan, dict[str, Any]]:
        """``batch``'s shape bucket of ``entry`` and the batch on the device (see
        ``BatchRouter.pick``); refused first when the state cannot be used."""
        self.store.check_usable()
        return self.router.pick(entry, batch, local)

    def match(
        self, entry: str, plans: Sequence[Plan], batch: Mapping[str, Any], local: bool = False
    ) -> tuple[CompiledPlan, dict[str, Any]]:
        """``BatchRouter.match``, refused first when the state cannot be used."""
        self.store.check_usable()
        return self.router.match(entry, plans, batch, local)

    # ------------------------------------------------------------ dispatch
    def args(self, plan: CompiledPlan, dev_batch: Mapping[str, Any], seed: int | None) -> list[Any]:
        """The argument list of ``plan``: state, batch, seed and hyperparameters."""
        args = plan.arguments(self.store.buffers, dev_batch)
        if plan.seed_slot is not None:
            assert seed is not None
            args[plan.seed_slot] = self._put_scalar(np.array(seed, dtype=np.uint64).view(np.int64))
        for pos, name in plan.hyper_slots:
            args[pos] = self.hp.buffer(name)
        return args

    def step(self, plan: CompiledPlan, dev_batch: Mapping[str, Any]) -> dict[str, Any]:
        """One training step of ``plan`` on a placed batch; its (lazy) metrics."""
        progress = self.progress
        if self.hp.schedules:
            # Checked before dispatch: nothing has been donated yet.
            self.hp.apply_schedules(progress.step)
        args = self.args(plan, dev_batch, progress.seed)
        try:
            outs = plan.dispatch(args)
        except _compat.JaxRuntimeError as e:
            raise self.device_error(plan, e) from e
        metrics = {name: outs[pos] for pos, name in plan.metric_slots}
        if self.stop_on_nonfinite:
            # Compiled without donation: on a refusal the old state is intact.
            check_step(
                progress.step,
                metrics,
                [outs[pos] for pos, _ in plan.update_slots] if self.check_state else None,
            )
        st = self.store.buffers
        for pos, si in plan.update_slots:
            st[si] = outs[pos]
        progress.advance(1)
        return metrics

    def evaluate(self, plan: CompiledPlan, dev_batch: Mapping[str, Any]) -> dict[str, Any]:
        """Run a read-only plan on the state; nothing is donated or changed."""
        self.store.check_usable()
        args = self.args(plan, dev_batch, None)
        try:
            outs = plan.dispatch(args)
        except _compat.JaxRuntimeError as e:
            raise self.device_error(plan, e) from e
        return {name: outs[pos] for pos, name in plan.metric_slots}

    def device_error(self, plan: CompiledPlan, e: Exception) -> DeviceError:
        """The error for a failure inside XLA or the device (the arguments were checked
        before the call); a program that donated leaves the state broken."""
        if plan.compiled.donating:
            self.store.broken = (
                f"A step failed inside the device runtime ({e}); its donated state "
                "buffers may be gone. Load a checkpoint (trainer.load_checkpoint) or "
                "the bundle again to continue."
            )
            return DeviceError(self.store.broken)
        return DeviceError(
            f"A step failed inside the device runtime ({e}); it donated nothing, so the "
            "state is as it was before the step."
        )
