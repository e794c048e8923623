"""K steps per call: the part of ``Trainer`` that runs a stack of K batches in one call.

``load(..., steps_per_call=K)`` compiles each train bucket a second time behind a loop
over K stacked batches (``multistep.py``); this mixin stacks batches, dispatches those
programs, and falls back to single steps where a call cannot run (a group that does not
fill one bucket, a non-finite value under ``stop_on_nonfinite``). ``Trainer`` sets every
attribute below and provides the single-step methods named here.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from stepbundle.schema.rng import advance_seed

from . import _compat
from .batches import BatchChecks
from .errors import BatchStackError, BindingError, DeviceError
from .hyper import Hyperparameters
from .metrics import StepMetric
from .plan import CompiledPlan
from .watch import finite

__all__ = ["StepCalls"]

_END: Any = object()  # what next() returns from an exhausted batch iterator


class StepCalls(BatchChecks):
    """``Trainer.step_many`` and ``run``'s dispatch of K steps per call."""

    data_position: Any
    _state: list[Any]
    _step: int
    _seed: int | None
    _seed_rule: str
    _seed_draws: int
    _hp: Hyperparameters
    _hyper: dict[str, float]
    _hyper_bufs: dict[str, Any]
    _k: int
    _stacked_plans: dict[int, CompiledPlan]
    _stop_on_nonfinite: bool
    _check_state: bool
    _stop_requested: bool
    _put_scalar: Callable[[np.ndarray[Any, Any]], Any]
    _check_schedules_set: Callable[[], None]
    _dispatch: Callable[[CompiledPlan, Mapping[str, Any]], dict[str, Any]]
    _device_error: Callable[[CompiledPlan, Exception], DeviceError]

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
        self._check_schedules_set()
        k = self._k
        if k == 1:
            raise BatchStackError(
                "step_many() runs K steps per call, but this trainer was loaded with "
                "steps_per_call=1. Load the bundle with steps_per_call=K (K > 1), or "
                "call step() once per batch."
            )
        plans = [self._stacked_plans[i] for i in sorted(self._stacked_plans)]
        if not plans:
            raise BatchStackError(
                "No shape bucket of the 'train' entry can run here, so there is nothing "
                "for step_many() to run."
            )
        try:
            plan, arrays = self._match("train", plans, batches)
        except BatchStackError:
            raise
        except BindingError as e:
            raise BatchStackError(
                f"step_many() takes a stack of {k} batches: every batch input with a "
                f"leading axis of {k} (this trainer's steps_per_call). {e}"
            ) from None
        dev = {name: self._to_device_stacked(arrays[name]) for name in plan.batch_sig}
        metrics = self._dispatch_stacked(plan, dev)
        if metrics is not None:
            return metrics
        # Something was not finite: run the call's steps one at a time, so the step at
        # fault is refused with the state from before it (check_step says which).
        single = self._plans_for("train")[plan.index]
        assert isinstance(single, CompiledPlan)
        host = {
            name: _compat.to_host(a) if hasattr(a, "sharding") else np.asarray(a)
            for name, a in arrays.items()
        }
        rows = [
            self._dispatch(single, self._transfer(single, {n: h[j] for n, h in host.items()}))
            for j in range(k)
        ]
        return {name: np.stack([np.asarray(r[name]) for r in rows]) for name in rows[0]}

    def _to_device_stacked(self, a: Any) -> Any:
        if not isinstance(a, np.ndarray) and getattr(a, "sharding", None) is not None:
            want = self.placement.split_stacked if a.ndim >= 2 else self.placement.replicated
            try:
                if a.sharding.is_equivalent_to(want, a.ndim):
                    return a
            except (ValueError, TypeError, NotImplementedError, AttributeError):
                pass
            a = _compat.to_host(a)
        return self.placement.put_stacked_batch(np.asarray(a))

    def _dispatch_stacked(
        self, plan: CompiledPlan, dev: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Run one K-step call; None (nothing applied) when, with ``stop_on_nonfinite``,
        a value is not finite or a scheduled value is refused: the caller then replays
        the call one step at a time, which refuses the step at fault exactly as single
        steps would."""
        k = self._k
        try:
            rows = self._hp.rows(self._step, k)
        except BindingError:
            return None  # the replay raises it at its step, after the steps before it
        args = plan.arguments(self._state, dev)
        st = self._state
        if plan.seed_slot is not None:
            assert self._seed is not None
            seeds = [self._seed]
            for _ in range(k - 1):
                seeds.append(advance_seed(self._seed_rule, seeds[-1], 1, self._seed_draws))
            args[plan.seed_slot] = self._put_scalar(np.array(seeds, dtype=np.uint64).view(np.int64))
        for pos, name in plan.hyper_slots:
            args[pos] = self._hp.stacked_buffer(name, rows[name])
        try:
            outs = plan.dispatch(args)
        except _compat.JaxRuntimeError as e:
            raise self._device_error(plan, e) from e
        metrics = {name: outs[pos] for pos, name in plan.metric_slots}
        if self._stop_on_nonfinite and not finite(
            metrics, [outs[pos] for pos, _ in plan.update_slots] if self._check_state else None
        ):
            return None  # compiled without donation: the old state is intact
        for pos, si in plan.update_slots:
            st[si] = outs[pos]
        self._step += k
        if self._seed is not None:
            self._seed = advance_seed(self._seed_rule, self._seed, k, self._seed_draws)
        for name, row in rows.items():
            if self._hyper[name] != row[-1]:  # the value the last step received
                self._hyper[name] = row[-1]
                self._hyper_bufs.pop(name, None)
        return metrics

    def _stack(self, group: list[tuple[CompiledPlan, dict[str, Any], Any]]) -> Any:
        """The K-step plan and device stacks for a group of batches, or None when the
        group does not fill a call of one bucket (it then runs one step at a time)."""
        if len(group) != self._k:
            return None
        plan = group[0][0]
        if any(p is not plan for p, _, _ in group):
            return None
        stacked = self._stacked_plans.get(plan.index)
        if stacked is None:
            return None
        dev = {}
        for name in plan.batch_sig:
            rows = [a[name] for _, a, _ in group]
            host = [_compat.to_host(r) if hasattr(r, "sharding") else np.asarray(r) for r in rows]
            dev[name] = self.placement.put_stacked_batch(np.stack(host))
        return stacked, dev

    def _run_calls(
        self,
        source: Iterator[Mapping[str, Any]],
        steps: int,
        on_step: Callable[[int, dict[str, Any]], object] | None,
        position: Callable[[], Any] | None,
        local: bool,
        keep_metrics: bool,
    ) -> list[dict[str, Any]]:
        """``run`` with K steps per call (see ``run``)."""
        k = self._k
        out: list[dict[str, Any]] = []
        left = steps
        i = 0

        def read(n: int) -> tuple[list[tuple[CompiledPlan, dict[str, Any], Any]], Exception | None]:
            group: list[tuple[CompiledPlan, dict[str, Any], Any]] = []
            for _ in range(n):
                try:  # a data source failing (a shard truncated) or a batch no bucket takes
                    b = next(source, _END)
                    if b is _END:
                        break
                    plan, arrays = self._match("train", self._plans_for("train"), b, local)
                except BindingError as e:
                    return group, e  # the steps before it run first
                group.append((plan, arrays, position() if position is not None else None))
            return group, None

        # Calls start at multiples of K steps, so a resumed run's calls end where a
        # run from step 0 would end them (and checkpoints every multiple of K steps
        # fall between calls): single steps up to the next multiple first.
        group, error = read(min((-self._step) % k or k, left))
        prepared = self._stack(group)
        while group:
            left -= len(group)
            metrics = self._dispatch_stacked(*prepared) if prepared is not None else None
            if metrics is not None:
                # The call runs: read and move the next group meanwhile.
                nxt, nxt_error = read(min(k, left)) if left > 0 and error is None else ([], error)
                nxt_prepared = self._stack(nxt)
                if group[-1][2] is not None:
                    self.data_position = group[-1][2]
                for j in range(len(group)):
                    m = {name: StepMetric(v, j) for name, v in metrics.items()}
                    if on_step is not None:
                        on_step(i, m)
                    i += 1
                    if keep_metrics:
                        out.append(m)
                    else:
                        out[:] = [m]
            else:
                for plan, arrays, pos in group:
                    m = self._dispatch(plan, self._transfer(plan, arrays, local))
                    if pos is not None:
                        self.data_position = pos
                    if on_step is not None:
                        on_step(i, m)
                    i += 1
                    if keep_metrics:
                        out.append(m)
                    else:
                        out[:] = [m]
                    if self._stop_requested:
                        return out
                nxt, nxt_error = read(min(k, left)) if left > 0 and error is None else ([], error)
                nxt_prepared = self._stack(nxt)
            if self._stop_requested:
                return out
            group, error, prepared = nxt, nxt_error, nxt_prepared
        if error is not None:
            raise error
        return out
