"""The lean trainer: owns the training state on the device and runs a bundle's steps.

The hot path (``Trainer.step``) does only what a step needs: check the batch against
the programs (before anything is dispatched, so a rejected call donates nothing), move
the batch to the device, assemble the argument list from precomputed slots, execute
asynchronously, and swap the donated state buffers for their updates. Metrics come
back as device arrays; reading one (``float(m["loss"])``) is what waits for the step.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepbundle.schema.manifest import (
    BatchInput,
    ConstantInput,
    HyperparameterInput,
    Manifest,
    MetricOutput,
    Program,
    RngSeedInput,
    StateInput,
    StateUpdateOutput,
)

from . import _compat
from .dtypes import describe, to_numpy
from .errors import BindingError, NonFiniteLossError
from .packing import Layout, Pack
from .program import CompiledProgram
from .sharding import Placement

__all__ = ["Trainer", "advance_seed"]

_U64 = 2**64
SEED_MUL = 7012063
SEED_ADD = 1012031


def advance_seed(seed: int, steps: int = 1) -> int:
    """torch_xla's per-step seed rule: ``next = (1012031 + seed * 7012063) mod 2**64``."""
    for _ in range(steps):
        seed = (SEED_ADD + seed * SEED_MUL) % _U64
    return seed


@dataclass
class _Plan:
    """How to feed one compiled program from the trainer's state, precomputed at load."""

    entry: str
    index: int
    compiled: CompiledProgram | None
    template: list[Any]
    state_slots: list[tuple[int, int]]
    batch_slots: list[tuple[int, str]]
    seed_slot: int | None
    hyper_slots: list[tuple[int, str]]
    metric_slots: list[tuple[int, str]]
    update_slots: list[tuple[int, int]]
    batch_sig: dict[str, tuple[tuple[int, ...], np.dtype[Any]]]
    loss_slot: int | None = None
    signature_text: str = ""
    dispatch: Any = None
    # Set when this shape bucket cannot run where the trainer runs (a batch that does
    # not split over the data-parallel devices); the program was not compiled.
    refusal: str | None = None

    @property
    def executable(self) -> Any:
        return self.compiled.executable if self.compiled is not None else None


@dataclass
class LoadInfo:
    """How loading went: seconds per stage and compile-cache hits."""

    seconds: dict[str, float] = field(default_factory=dict)
    cache_hits: int = 0
    compiled: int = 0


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
        plans: dict[str, list[_Plan]],
        hyperparameters: dict[str, float],
        seed: int | None,
        stop_on_nonfinite: bool,
        load_info: LoadInfo,
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
        self._hyper = dict(hyperparameters)
        self._hyper_bufs: dict[str, Any] = {}
        self._schedules: dict[str, Callable[[int], float]] = {}
        self._seed = seed
        self._step = 0
        self._put_scalar = placement.put_replicated
        self._stop_on_nonfinite = stop_on_nonfinite
        self._broken: str | None = None

    # ------------------------------------------------------------ properties
    @property
    def entries(self) -> tuple[str, ...]:
        return tuple(self._plans)

    @property
    def step_count(self) -> int:
        """Number of training steps taken (restored from checkpoints)."""
        return self._step

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
    def _resolve_hyper(self, name: str) -> list[str]:
        if name in self._hyper:
            return [name]
        matches = [
            n for n in self._hyper if n.startswith("param_groups.") and n.rsplit(".", 1)[-1] == name
        ]
        if matches:
            return matches
        known = ", ".join(sorted(self._hyper)) or "none"
        raise BindingError(
            f"The bundle has no hyperparameter {name!r} (it has: {known}). Declare it at "
            "export with Recipe(hyperparameters=(...))."
        )

    def set_hyperparameter(self, name: str, value: float) -> None:
        """Set a hyperparameter for the following steps (``lr`` sets every group's lr)."""
        v = float(value)
        if not math.isfinite(v):
            raise BindingError(f"Hyperparameter {name!r} must be finite, got {value!r}.")
        for n in self._resolve_hyper(name):
            if self._hyper[n] != v:
                self._hyper[n] = v
                self._hyper_bufs.pop(n, None)

    def set_schedule(self, name: str, schedule: Callable[[int], float] | None) -> None:
        """Call ``schedule(step)`` before every training step and set ``name`` to it.

        ``step`` is the number of steps taken so far (0 for the first). ``None`` removes
        the schedule.
        """
        for n in self._resolve_hyper(name):
            if schedule is None:
                self._schedules.pop(n, None)
            else:
                self._schedules[n] = schedule

    def _hyper_buf(self, name: str) -> Any:
        buf = self._hyper_bufs.get(name)
        if buf is None:
            spec = next(h.spec for h in self.manifest.hyperparameters if h.name == name)
            buf = self._put_scalar(np.asarray(self._hyper[name], dtype=to_numpy(spec.dtype)))
            self._hyper_bufs[name] = buf
        return buf

    # ---------------------------------------------------------------- checks
    def _plans_for(self, entry: str) -> list[_Plan]:
        plans = self._plans.get(entry)
        if plans is None:
            raise BindingError(
                f"The bundle has no {entry!r} entry (it has: {', '.join(self._plans)}). "
                + ("Export it with Recipe(eval_step=...)." if entry == "eval" else "")
            )
        return plans

    def _pick(self, entry: str, batch: Mapping[str, Any]) -> tuple[_Plan, dict[str, Any]]:
        """Choose the shape bucket for ``batch`` and move the batch to the device.

        Everything that can be wrong with a batch is found here, before dispatch.
        """
        if self._broken is not None:
            raise BindingError(self._broken)
        if not isinstance(batch, Mapping):
            raise BindingError(
                f"A batch must be a dict of name -> array, got {type(batch).__name__}."
            )
        plans = self._plans_for(entry)
        arrays: dict[str, Any] = {}
        for k, v in batch.items():
            if not hasattr(v, "shape") or not hasattr(v, "dtype"):
                v = np.asarray(v)
            arrays[k] = v
        chosen: _Plan | None = None
        for plan in plans:
            sig = plan.batch_sig
            if len(sig) != len(arrays):
                continue
            ok = True
            for k, (shape, dt) in sig.items():
                a = arrays.get(k)
                if a is None or tuple(a.shape) != shape or np.dtype(a.dtype) != dt:
                    ok = False
                    break
            if ok:
                chosen = plan
                break
        if chosen is None:
            raise BindingError(self._mismatch_message(entry, plans, arrays))
        if chosen.refusal is not None:
            raise BindingError(chosen.refusal)
        dev: dict[str, Any] = {}
        for k in chosen.batch_sig:
            dev[k] = self._to_device(arrays[k])
        return chosen, dev

    def _to_device(self, a: Any) -> Any:
        if isinstance(a, np.ndarray):
            return self.placement.put_batch(a)
        # A device array: use it where it is when it already has the sharding needed.
        if self.placement.holds(a, split=a.ndim >= 1):
            return a
        if getattr(a, "is_fully_addressable", True) is False:
            # Gathering it would be a collective the other processes are not running.
            raise BindingError(
                "A batch array spread over other processes' devices must already have the "
                f"batch sharding ({self.placement.split}); pass numpy arrays instead, and "
                "every process copies its own rows."
            )
        return self.placement.put_batch(
            _compat.to_host(a) if hasattr(a, "sharding") else np.asarray(a)
        )

    def _mismatch_message(self, entry: str, plans: list[_Plan], arrays: Mapping[str, Any]) -> str:
        got = (
            ", ".join(f"{k}: {describe(a.dtype, tuple(a.shape))}" for k, a in arrays.items())
            or "nothing"
        )
        expected = " | ".join(p.signature_text for p in plans)
        lines = [f"The batch does not match any shape bucket of the {entry!r} entry."]
        lines.append(f"  expected: {expected}")
        lines.append(f"  got:      {got}")
        names = set(plans[0].batch_sig)
        missing = sorted(names - set(arrays))
        extra = sorted(set(arrays) - names)
        if missing:
            lines.append(f"Missing batch input(s): {', '.join(missing)}.")
        if extra:
            lines.append(f"Unexpected batch input(s): {', '.join(extra)}; remove them.")
        if not missing and not extra:
            for k, a in arrays.items():
                want = {
                    (shape, dt) for p in plans for kk, (shape, dt) in p.batch_sig.items() if kk == k
                }
                if all(np.dtype(a.dtype) != dt for _, dt in want):
                    dts = sorted({describe(dt, s) for s, dt in want})
                    lines.append(
                        f"Dtype mismatch for batch input {k!r}: the bundle expects "
                        f"{' or '.join(dts)}, got {describe(a.dtype, tuple(a.shape))}. Cast the "
                        f"array, or re-export with a {np.dtype(a.dtype).name} example batch."
                    )
                elif all(tuple(a.shape) != s for s, _ in want):
                    lines.append(
                        f"Shape mismatch for batch input {k!r}: got {tuple(a.shape)}, the "
                        f"bundle has buckets {sorted({s for s, _ in want})}. Pad or split the "
                        "batch, or re-export with an example batch of this shape."
                    )
        return "\n".join(lines)

    # -------------------------------------------------------------- stepping
    def _args(self, plan: _Plan, dev_batch: Mapping[str, Any], seed: int | None) -> list[Any]:
        args = plan.template.copy()
        st = self._state
        for pos, si in plan.state_slots:
            args[pos] = st[si]
        for pos, name in plan.batch_slots:
            args[pos] = dev_batch[name]
        if plan.seed_slot is not None:
            assert seed is not None
            args[plan.seed_slot] = self._put_scalar(np.array(seed, dtype=np.uint64).view(np.int64))
        for pos, name in plan.hyper_slots:
            args[pos] = self._hyper_buf(name)
        return args

    def _dispatch(self, plan: _Plan, dev_batch: Mapping[str, Any]) -> dict[str, Any]:
        if self._schedules:
            for name, fn in self._schedules.items():
                v = float(fn(self._step))
                if self._hyper[name] != v:
                    self._hyper[name] = v
                    self._hyper_bufs.pop(name, None)
        args = self._args(plan, dev_batch, self._seed)
        try:
            outs = plan.dispatch(args)
        except Exception as e:
            if plan.compiled is not None and plan.compiled.donating:
                self._broken = (
                    f"A step failed inside the device runtime ({e}); its donated state "
                    "buffers may be gone. Load a checkpoint (trainer.load_checkpoint) or "
                    "the bundle again to continue."
                )
            raise
        metrics = {name: outs[pos] for pos, name in plan.metric_slots}
        if self._stop_on_nonfinite and plan.loss_slot is not None:
            loss = float(np.asarray(outs[plan.loss_slot]))
            if not math.isfinite(loss):
                # The program was compiled without donation: the old state is intact.
                raise NonFiniteLossError(
                    f"Step {self._step} produced a non-finite loss ({loss}). The trainer "
                    "kept the state from before this step; save it with "
                    "trainer.save_checkpoint(...) and lower the learning rate or inspect "
                    "the batch.",
                    step=self._step,
                    metrics={
                        k: float(np.asarray(v).reshape(-1)[0])
                        for k, v in metrics.items()
                        if np.asarray(v).size == 1
                    },
                )
        st = self._state
        for pos, si in plan.update_slots:
            st[si] = outs[pos]
        self._step += 1
        if self._seed is not None:
            self._seed = (SEED_ADD + self._seed * SEED_MUL) % _U64
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
        plan, dev = self._pick("train", batch)
        return self._dispatch(plan, dev)

    def run(
        self,
        batches: Sequence[Mapping[str, Any]],
        steps: int,
        on_step: Callable[[int, dict[str, Any]], None] | None = None,
        *,
        offset: int = 0,
        keep_metrics: bool = True,
    ) -> list[dict[str, Any]]:
        """Run ``steps`` training steps, step ``i`` on ``batches[(offset + i) % len(batches)]``.

        The next batch is moved to the device while the current step runs. ``on_step``
        is called with ``i`` and the step's (lazy) metrics. A resumed run passes its
        step count as ``offset`` to continue through the batches where it left off.
        Returns every step's metrics; for long runs pass ``keep_metrics=False`` (and read
        them in ``on_step``), which returns only the last step's, so memory stays flat.
        """
        if not batches:
            raise BindingError("run() needs at least one batch.")
        out: list[dict[str, Any]] = []
        if steps <= 0:
            return out
        n = len(batches)
        nxt = self._pick("train", batches[offset % n])
        for i in range(steps):
            plan, dev = nxt
            metrics = self._dispatch(plan, dev)
            if i + 1 < steps:
                # Dispatch was asynchronous: this transfer overlaps the running step.
                nxt = self._pick("train", batches[(offset + i + 1) % n])
            if on_step is not None:
                on_step(i, metrics)
            if keep_metrics or i + 1 == steps:
                out.append(metrics)
        return out

    def evaluate(self, batch: Mapping[str, Any], entry: str = "eval") -> dict[str, Any]:
        """Run a read-only entry on the current state. Nothing is donated or changed."""
        plan, dev = self._pick(entry, batch)
        if self._broken is not None:
            raise BindingError(self._broken)
        args = self._args(plan, dev, None)
        outs = plan.dispatch(args)
        return {name: outs[pos] for pos, name in plan.metric_slots}

    # ----------------------------------------------------------------- state
    def state_dict(self, *, include_aliases: bool = True) -> dict[str, np.ndarray[Any, Any]]:
        """The current state as numpy arrays (copies), under PyTorch's names.

        Tied weights appear under each of their names, as in ``module.state_dict()``.
        """
        if self._broken is not None:
            raise BindingError(self._broken)
        values: dict[str, np.ndarray[Any, Any]] = {}
        for entry, buf in zip(self._layout.buffers, self._state):
            host = _compat.to_host(buf)  # one transfer per buffer
            if isinstance(entry, Pack):
                for m in entry.members:
                    values[m.state] = host[m.offset : m.offset + m.numel].reshape(m.shape).copy()
            else:
                values[entry] = host
        out: dict[str, np.ndarray[Any, Any]] = {}
        for name in self._names:
            out[name] = values[name]
            if include_aliases:
                for alias in self._aliases.get(name, ()):
                    out[alias] = values[name]
        return out

    def load_state_dict(self, values: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """Replace the state with ``values`` (every state name, exact dtypes and shapes)."""
        from .checkpoint import check_state_values

        arrays = check_state_values(self.manifest, values)
        self._state = [
            self.placement.put_state(name, a)
            for name, a in zip(self._layout.buffer_names, host_buffers(self._layout, arrays))
        ]
        self._broken = None

    def block_until_ready(self) -> None:
        """Wait until every dispatched step has finished."""
        _compat.block(self._state)

    def save_checkpoint(self, path: str | Any) -> None:
        """Write the state, step count, RNG seed and hyperparameters atomically.

        The file is safetensors with PyTorch's state names; the step count, seed and
        hyperparameters sit in its metadata (``stepbundle`` key, JSON), so the write is
        one atomic rename.
        """
        from .checkpoint import save_checkpoint

        save_checkpoint(self, path)

    def load_checkpoint(self, path: str | Any) -> None:
        """Restore state, step count, seed and hyperparameters exactly."""
        from .checkpoint import load_checkpoint

        load_checkpoint(self, path)


def host_buffers(
    layout: Layout, arrays: Mapping[str, np.ndarray[Any, Any]]
) -> list[np.ndarray[Any, Any]]:
    """The host arrays of the layout's buffers: packs concatenated, others as they are."""
    out = []
    for entry in layout.buffers:
        if isinstance(entry, Pack):
            out.append(
                np.concatenate([np.asarray(arrays[m.state]).reshape(-1) for m in entry.members])
            )
        else:
            out.append(np.asarray(arrays[entry]))
    return out


def batch_text(program: Program) -> str:
    """The shape bucket as users see it in errors: ``{x: f32[8,5], y: f32[8,3]}``."""
    return "{" + ", ".join(f"{b.name}: {b.spec}" for b in program.batch) + "}"


def _batch_signature(program: Program) -> tuple[dict[str, Any], str]:
    sig = {b.name: (tuple(b.spec.shape), to_numpy(b.spec.dtype)) for b in program.batch}
    return sig, batch_text(program)


def refused_plan(entry: str, index: int, program: Program, refusal: str) -> _Plan:
    """A plan for a shape bucket that cannot run here: batches of its shape are refused
    with ``refusal`` before anything is dispatched. Its program is not compiled."""
    sig, text = _batch_signature(program)
    return _Plan(
        entry=entry,
        index=index,
        compiled=None,
        template=[],
        state_slots=[],
        batch_slots=[],
        seed_slot=None,
        hyper_slots=[],
        metric_slots=[],
        update_slots=[],
        batch_sig=sig,
        signature_text=text,
        refusal=refusal,
    )


def build_plan(
    entry: str,
    index: int,
    compiled: CompiledProgram,
    state_index: Mapping[str, int],
    constants: Mapping[str, Any],
    placement: Placement,
) -> _Plan:
    """Precompute where each argument comes from and where each result goes."""
    program = compiled.program
    template: list[Any] = [None] * len(program.inputs)
    state_slots, batch_slots, hyper_slots = [], [], []
    seed_slot = None
    for i, inp in enumerate(program.inputs):
        if isinstance(inp, StateInput):
            state_slots.append((i, state_index[inp.name]))
        elif isinstance(inp, BatchInput):
            batch_slots.append((i, inp.name))
        elif isinstance(inp, RngSeedInput):
            seed_slot = i
        elif isinstance(inp, HyperparameterInput):
            hyper_slots.append((i, inp.name))
        elif isinstance(inp, ConstantInput):
            template[i] = constants[inp.section]
    metric_slots, update_slots = [], []
    loss_slot = None
    for j, out in enumerate(program.outputs):
        if isinstance(out, MetricOutput):
            metric_slots.append((j, out.name))
            if out.name == "loss":
                loss_slot = j
        elif isinstance(out, StateUpdateOutput):
            update_slots.append((j, state_index[out.state]))
    sig, text = _batch_signature(program)
    return _Plan(
        entry=entry,
        index=index,
        compiled=compiled,
        template=template,
        state_slots=state_slots,
        batch_slots=batch_slots,
        seed_slot=seed_slot,
        hyper_slots=hyper_slots,
        metric_slots=metric_slots,
        update_slots=update_slots,
        batch_sig=sig,
        loss_slot=loss_slot,
        signature_text=text,
        dispatch=_compat.Dispatcher(
            compiled.executable,
            [(o.spec.shape, to_numpy(o.spec.dtype)) for o in program.outputs],
            placement.output_shardings(program),
            partitioned=placement.partitioned,
        ),
    )


def iter_batches(data: Mapping[str, np.ndarray[Any, Any]]) -> list[dict[str, np.ndarray[Any, Any]]]:
    """Split an npz-style dict of stacked arrays ``(S, *shape)`` into S batches."""
    sizes = {k: int(v.shape[0]) for k, v in data.items() if getattr(v, "ndim", 0) >= 1}
    if not data or len(sizes) != len(data) or len(set(sizes.values())) != 1:
        raise BindingError(
            "The data file must hold one array per batch input, each shaped (S, *batch "
            f"shape) with the same S; got { ({k: tuple(np.shape(v)) for k, v in data.items()}) }."
        )
    s = next(iter(sizes.values()))
    return [{k: np.asarray(v[i], order="C") for k, v in data.items()} for i in range(s)]
