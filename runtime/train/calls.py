"""K steps per call: the part of ``Trainer`` that runs a stack of K batches in one call.

``CompileOptions(steps_per_call=K)`` compiles each train bucket a second time behind a loop
over K stacked batches (``multistep.py``); ``StackedCalls`` owns those programs, stacks
batches, dispatches them, and falls back to single steps (``Dispatcher.step``) where a
call cannot run (a group that does not fill one bucket, a non-finite value under
``stop_on_nonfinite``). ``runs.py`` groups a run's batches into calls.

Imports: numpy, jax/jaxlib (through _compat).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import _compat
from ..errors import BatchStackError, BindingError
from .dispatch import Dispatcher
from .plan import CompiledPlan
from .watch import finite

__all__ = ["Group", "StackedCalls"]

Group = list[tuple[CompiledPlan, dict[str, Any], Any]]
"""Batches read for one call: each one's plan, its arrays, and the data position after it."""


class StackedCalls:
    """``Trainer.step_many`` and the K-step calls of ``run``.

    Attributes:
      k: steps per call (1: the trainer runs one step per call).
      plans: the train buckets' K-step plans, by bucket index.
    """

    def __init__(self, dispatcher: Dispatcher, k: int, plans: Mapping[int, CompiledPlan]) -> None:
        self.k = k
        self.plans = dict(plans)
        self._d = dispatcher
        self._placement = dispatcher.router.placement

    def step_many(self, batches: Mapping[str, Any]) -> dict[str, Any]:
        """``Trainer.step_many``."""
        self._d.hp.check_pending()
        k = self.k
        if k == 1:
            raise BatchStackError(
                "step_many() runs K steps per call, but this trainer was loaded with "
                "steps_per_call=1. Load the bundle with steps_per_call=K (K > 1), or "
                "call step() once per batch."
            )
        plans = [self.plans[i] for i in sorted(self.plans)]
        if not plans:
            raise BatchStackError(
                "No shape bucket of the 'train' entry can run here, so there is nothing "
                "for step_many() to run."
            )
        try:
            plan, arrays = self._d.match("train", plans, batches)
        except BatchStackError:
            raise
        except BindingError as e:
            raise BatchStackError(
                f"step_many() takes a stack of {k} batches: every batch input with a "
                f"leading axis of {k} (this trainer's steps_per_call). {e}"
            ) from None
        dev = {name: self._to_device(arrays[name]) for name in plan.batch_sig}
        metrics = self.dispatch(plan, dev)
        if metrics is not None:
            return metrics
        # Something was not finite: run the call's steps one at a time, so the step at
        # fault is refused with the state from before it (check_step says which).
        single = self._d.router.plans_for("train")[plan.index]
        assert isinstance(single, CompiledPlan)
        host = {
            name: _compat.to_host(a) if hasattr(a, "sharding") else np.asarray(a)
            for name, a in arrays.items()
        }
        rows = [
            self._d.step(
                single, self._d.router.transfer(single, {n: h[j] for n, h in host.items()})
            )
            for j in range(k)
        ]
        return {name: np.stack([np.asarray(r[name]) for r in rows]) for name in rows[0]}

    def _to_device(self, a: Any) -> Any:
        if not isinstance(a, np.ndarray) and getattr(a, "sharding", None) is not None:
            want = self._placement.split_stacked if a.ndim >= 2 else self._placement.replicated
            try:
                if a.sharding.is_equivalent_to(want, a.ndim):
                    return a
            except (ValueError, TypeError, NotImplementedError, AttributeError):
                pass
            a = _compat.to_host(a)
        return self._placement.put_stacked_batch(np.asarray(a))

    def dispatch(self, plan: CompiledPlan, dev: Mapping[str, Any]) -> dict[str, Any] | None:
        """Run one K-step call; None (nothing applied) when, with ``stop_on_nonfinite``,
        a value is not finite or a scheduled value is refused: the caller then replays
        the call one step at a time, which refuses the step at fault exactly as single
        steps would."""
        k, d = self.k, self._d
        try:
            rows = d.hp.rows(d.progress.step, k)
        except BindingError:
            return None  # the replay raises it at its step, after the steps before it
        st = d.store.buffers
        args = plan.arguments(st, dev)
        if plan.seed_slot is not None:
            seeds = d.progress.seeds(k)
            args[plan.seed_slot] = self._placement.put_replicated(
                np.array(seeds, dtype=np.uint64).view(np.int64)
            )
        for pos, name in plan.hyper_slots:
            args[pos] = d.hp.stacked_buffer(name, rows[name])
        try:
            outs = plan.dispatch(args)
        except _compat.JaxRuntimeError as e:
            raise d.device_error(plan, e) from e
        metrics = {name: outs[pos] for pos, name in plan.metric_slots}
        if d.stop_on_nonfinite and not finite(
            metrics, [outs[pos] for pos, _ in plan.update_slots] if d.check_state else None
        ):
            return None  # compiled without donation: the old state is intact
        for pos, si in plan.update_slots:
            st[si] = outs[pos]
        d.progress.advance(k)
        d.hp.settle(rows)  # each value is the one the last step received
        return metrics

    def stack(self, group: Group) -> Any:
        """The K-step plan and device stacks for a group of batches, or None when the
        group does not fill a call of one bucket (it then runs one step at a time)."""
        if len(group) != self.k:
            return None
        plan = group[0][0]
        if any(p is not plan for p, _, _ in group):
            return None
        stacked = self.plans.get(plan.index)
        if stacked is None:
            return None
        dev = {}
        for name in plan.batch_sig:
            rows = [a[name] for _, a, _ in group]
            host = [_compat.to_host(r) if hasattr(r, "sharding") else np.asarray(r) for r in rows]
            dev[name] = self._placement.put_stacked_batch(np.stack(host))
        return stacked, dev
