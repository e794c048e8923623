"""Diagnostics for where a step's time goes beyond the math: dispatch, GC, per-buffer cost.

None of these is a stepbundle feature. Each runs the trainer's own bundle program, on the
trainer's own state, so they can be timed interleaved with ``stepbundle`` and ``floor``:

- ``floor_execute``: the same executable through ``LoadedExecutable.execute``, which
  builds every output array twice (once in ``execute_sharded`` and again in
  ``disassemble_into_single_device_arrays``); ``floor`` and the runtime build each once,
  through ``execute_sharded`` and one precomputed result handler per output.
- ``floor_jit``: the bundle's StableHLO artifact wrapped as a ``jax.export.Exported`` and
  called through ``jax.jit`` with the state donated: jax's C++ dispatch path on the
  same program (XLA compiles the same HLO; the instruction counts are recorded).
- ``packed_execute`` / ``packed_jit``: the same program behind a wrapper whose small
  state tensors (up to ``PACK_MAX_ELEMENTS``) live in one contiguous buffer per dtype
  (sliced apart and concatenated back inside the compiled program, the buffer donated),
  so a step passes a handful of buffers instead of hundreds; large tensors stay separate
  (and donated). Run through ``LoadedExecutable.execute`` (the runtime's path) and
  through ``jax.jit``.
- ``stepbundle_gc_frozen``: ``trainer.step`` with ``gc.freeze()`` applied before the
  block (as a runtime could do once after loading), so the collector stops re-scanning
  the long-lived objects of the process.

Imports: jax, numpy, stepbundle.runtime/schema.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from methods import Floor, Method, Stepbundle


def _x64() -> Any:
    from stepbundle.runtime import _compat

    return _compat.x64_scope()


def exported_program(trainer: Any, artifact: bytes) -> Any:
    """The train program as a ``jax.export.Exported`` (flat arguments, flat results)."""
    import jax
    from jax import export
    from jax._src import core

    from stepbundle.runtime.dtypes import to_numpy

    prog = trainer._router.plans["train"][0].compiled.program
    with _x64():
        in_avals = tuple(
            core.ShapedArray(i.spec.shape, to_numpy(i.spec.dtype)) for i in prog.inputs
        )
        out_avals = tuple(
            core.ShapedArray(o.spec.shape, to_numpy(o.spec.dtype)) for o in prog.outputs
        )
    n_in, n_out = len(in_avals), len(out_avals)
    return export.Exported(
        fun_name="main",
        in_tree=jax.tree.structure((tuple(range(n_in)), {})),
        in_avals=in_avals,
        out_tree=jax.tree.structure(tuple(range(n_out))),
        out_avals=out_avals,
        in_shardings_hlo=(None,) * n_in,
        out_shardings_hlo=(None,) * n_out,
        nr_devices=1,
        platforms=(str(trainer.device.platform),),
        ordered_effects=(),
        unordered_effects=(),
        disabled_safety_checks=(),
        mlir_module_serialized=bytes(artifact),
        calling_convention_version=9,
        module_kept_var_idx=tuple(range(n_in)),
        uses_global_constants=False,
        _get_vjp=None,
    )


def hlo_counts(executable: Any) -> dict[str, int]:
    text = executable.hlo_modules()[0].to_string()
    entry = text[text.index("ENTRY") :]
    return {
        "fusions": text.count(" fusion("),
        "entry_instructions": entry.count("\n  ") + 1,
        "copies": entry.count(" copy("),
    }


class FloorExecute(Floor):
    """The floor through ``LoadedExecutable.execute``, which builds every output twice.

    The runtime used this call before it switched to ``execute_sharded`` with
    precomputed result handlers (what ``floor`` and ``trainer.step`` use now); kept as
    a diagnostic of what that switch is worth.
    """

    name = "floor_execute"

    def __init__(self, trainer: Any, batches: Sequence[dict[str, np.ndarray]]) -> None:
        super().__init__(trainer, batches)
        self.exe = self.plan.executable.execute


class FloorJit(Floor):
    name = "floor_jit"

    def __init__(
        self, trainer: Any, batches: Sequence[dict[str, np.ndarray]], exported: Any
    ) -> None:
        import jax

        super().__init__(trainer, batches)
        donated = tuple(sorted(pos for _, pos in self.feed))
        self.fn = jax.jit(lambda *a: exported.call(*a), donate_argnums=donated, keep_unused=True)
        with _x64():
            self.compiled = self.fn.lower(*self._args(self.dev_batches[0])).compile()

    def block(self, k: int) -> float:
        plan, fn, feed = self.plan, self.compiled, self.feed
        batches = [[(pos, b[n]) for pos, n in plan.batch_slots] for b in self.dev_batches]
        args = self._args(self.dev_batches[0])
        nb, i = len(batches), self.i
        with _x64():
            t0 = time.perf_counter()
            for _ in range(k):
                for pos, a in batches[i % nb]:
                    args[pos] = a
                outs = fn(*args)
                for o, pos in feed:
                    args[pos] = outs[o]
                i += 1
            float(np.asarray(outs[self.loss_slot]))
            dt = time.perf_counter() - t0
        self.i = i
        for pos, si in plan.state_slots:
            self.trainer._store.buffers[si] = args[pos]
        return dt


PACK_MAX_ELEMENTS = 65536
"""Tensors up to this many elements are packed; larger ones stay separate buffers (still
donated), because slicing them out of and concatenating them back into a packed buffer
copies them on every step, which costs more than the per-buffer overhead it saves."""


class PackedProgram:
    """The bundle program behind a wrapper that keeps the small state in one buffer per dtype.

    Arguments of the wrapper: ``packed`` (one 1-D buffer per dtype holding every small
    donated state tensor, donated), ``big`` (the large donated state tensors, donated),
    ``rest`` (batch, constants, seed, hyperparameters). Results: the new ``packed`` and
    ``big``, the other state outputs (gradients: small ones packed per dtype, large ones
    as they are) and the metrics.
    """

    def __init__(
        self,
        trainer: Any,
        batches: Sequence[dict[str, np.ndarray]],
        exported: Any,
        max_elements: int = PACK_MAX_ELEMENTS,
    ) -> None:
        import jax
        import jax.numpy as jnp

        floor = Floor(trainer, batches)
        plan = floor.plan
        prog = plan.compiled.program
        self.floor = floor
        state_inputs = {pos: o for o, pos in floor.feed}  # donated input -> its update
        groups: dict[str, list[tuple[int, int, tuple[int, ...], int]]] = {}
        big: list[tuple[int, int]] = []  # (input position, output position)
        for pos in sorted(state_inputs):
            spec = prog.inputs[pos].spec
            if int(spec.numel) > max_elements:
                big.append((pos, state_inputs[pos]))
                continue
            groups.setdefault(spec.dtype.value, []).append(
                (pos, state_inputs[pos], tuple(spec.shape), int(spec.numel))
            )
        order = sorted(groups)
        metric_pos = [o for o, _ in plan.metric_slots]
        other_small: dict[str, list[int]] = {}
        other_big: list[int] = []
        for o, out in enumerate(prog.outputs):
            if o in floor.feed_outputs or o in metric_pos:
                continue
            if int(out.spec.numel) > max_elements:
                other_big.append(o)
            else:
                other_small.setdefault(out.spec.dtype.value, []).append(o)
        other_order = sorted(other_small)
        rest_pos = [p for p in range(len(prog.inputs)) if p not in state_inputs]

        def step(packed: list[Any], bigs: list[Any], rest: list[Any]) -> Any:
            args: list[Any] = [None] * len(prog.inputs)
            for buf, dt in zip(packed, order):
                off = 0
                for pos, _, shape, size in groups[dt]:
                    args[pos] = jax.lax.slice(buf, (off,), (off + size,)).reshape(shape)
                    off += size
            for (pos, _), a in zip(big, bigs):
                args[pos] = a
            for pos, a in zip(rest_pos, rest):
                args[pos] = a
            outs = exported.call(*args)
            new = [
                jnp.concatenate([outs[o].reshape(-1) for _, o, _, _ in groups[dt]]) for dt in order
            ]
            others = [
                jnp.concatenate([outs[o].reshape(-1) for o in other_small[dt]])
                for dt in other_order
            ] + [outs[o] for o in other_big]
            return new, [outs[o] for _, o in big], others, [outs[o] for o in metric_pos]

        base = floor._args(floor.dev_batches[0])
        self.groups, self.order, self.rest_pos, self.big = groups, order, rest_pos, big
        with _x64():
            packed, bigs, rest = self.initial(base)
            fn = jax.jit(step, donate_argnums=(0, 1), keep_unused=True)
            self.compiled = fn.lower(packed, bigs, rest).compile()
        self.exe = self.compiled.runtime_executable()
        self.base = base
        self.batch_rest = [
            [(rest_pos.index(pos), b[n]) for pos, n in plan.batch_slots] for b in floor.dev_batches
        ]
        self.n_packed = len(order)
        self.n_big = len(big)
        self.n_other = len(other_order) + len(other_big)
        self.loss_index = metric_pos.index(plan.loss_slot)
        self.n_buffers_in = len(order) + len(big) + len(rest_pos)
        self.n_buffers_out = len(order) + len(big) + self.n_other + len(metric_pos)

    def initial(self, base: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        """Device copies of the state, packed, and of everything else: (packed, big, rest)."""
        import jax.numpy as jnp

        packed = [
            jnp.concatenate([jnp.ravel(base[pos]) for pos, _, _, _ in self.groups[dt]])
            for dt in self.order
        ]
        bigs = [jnp.array(base[pos], copy=True) for pos, _ in self.big]
        rest = [jnp.array(base[p], copy=True) for p in self.rest_pos]
        return packed, bigs, rest


class Packed(Method):
    """Steps of a ``PackedProgram`` on its own copy of the state, packed at set-up."""

    def __init__(self, program: PackedProgram, *, via: str) -> None:
        self.name = f"packed_{via}"
        self.via = via
        self.p = program
        with _x64():
            self.packed, self.bigs, self.rest = program.initial(program.base)
        self.i = 0

    def block(self, k: int) -> float:
        p = self.p
        nb, i = len(p.batch_rest), self.i
        if self.via == "jit":
            fn, rest = p.compiled, list(self.rest)
            with _x64():
                t0 = time.perf_counter()
                for _ in range(k):
                    for j, a in p.batch_rest[i % nb]:
                        rest[j] = a
                    self.packed, self.bigs, _, metrics = fn(self.packed, self.bigs, rest)
                    i += 1
                float(np.asarray(metrics[p.loss_index]))
                dt = time.perf_counter() - t0
        else:
            exe, nfed = p.exe, p.n_packed + p.n_big
            args = list(self.packed) + list(self.bigs) + list(self.rest)
            loss_out = nfed + p.n_other + p.loss_index
            t0 = time.perf_counter()
            for _ in range(k):
                for j, a in p.batch_rest[i % nb]:
                    args[nfed + j] = a
                outs = exe.execute(args)
                args[:nfed] = outs[:nfed]
                i += 1
            float(np.asarray(outs[loss_out]))
            dt = time.perf_counter() - t0
            self.packed = args[: p.n_packed]
            self.bigs = args[p.n_packed : nfed]
        self.i = i
        return dt


class StepbundleGcFrozen(Stepbundle):
    name = "stepbundle_gc_frozen"

    def block(self, k: int) -> float:
        gc.freeze()
        try:
            return super().block(k)
        finally:
            gc.unfreeze()


def make(
    trainer: Any, bundle_path: Any, batches: Sequence[dict[str, np.ndarray]]
) -> tuple[list[Method], dict[str, Any]]:
    """The diagnostic methods for one loaded trainer, and facts about their programs."""
    import stepbundle.schema as codec

    prog = trainer._router.plans["train"][0].compiled.program
    with codec.open_bundle(bundle_path) as b:
        artifact = bytes(b.section(prog.section))
    exported = exported_program(trainer, artifact)
    t0 = time.perf_counter()
    fj = FloorJit(trainer, batches, exported)
    t1 = time.perf_counter()
    packed = PackedProgram(trainer, batches, exported)
    t2 = time.perf_counter()
    pe, pj = Packed(packed, via="execute"), Packed(packed, via="jit")
    facts = {
        "graph_inputs": len(prog.inputs),
        "graph_outputs": len(prog.outputs),
        "packed_inputs": packed.n_buffers_in,
        "packed_outputs": packed.n_buffers_out,
        "compile_s": {"floor_jit": t1 - t0, "packed": t2 - t1},
        "hlo": {
            "runtime": hlo_counts(trainer._router.plans["train"][0].executable),
            "jit": hlo_counts(fj.compiled.runtime_executable()),
            "packed": hlo_counts(packed.exe),
        },
        "first_loss": first_losses(trainer, packed, fj),
    }
    methods: list[Method] = [
        Stepbundle(trainer, batches),
        StepbundleGcFrozen(trainer, batches),
        Floor(trainer, batches),
        FloorExecute(trainer, batches),
        fj,
        pe,
        pj,
    ]
    return methods, facts


def first_losses(trainer: Any, packed: PackedProgram, fj: FloorJit) -> dict[str, float]:
    """One step of each variant from the same state and batch: the losses must agree."""
    import jax.numpy as jnp

    floor = packed.floor
    with _x64():
        copy = [jnp.array(a, copy=True) if a is not None else a for a in packed.base]
        ref = float(np.asarray(floor.exe(copy)[floor.loss_slot]))
        copy = [jnp.array(a, copy=True) for a in packed.base]
        via_jit = float(np.asarray(fj.compiled(*copy)[floor.loss_slot]))
        pk, bigs, rest = packed.initial(packed.base)
        via_packed = float(np.asarray(packed.compiled(pk, bigs, rest)[3][packed.loss_index]))
    return {"execute": ref, "jit": via_jit, "packed": via_packed}


def profile_steps(
    trainer: Any, batches: Sequence[dict[str, np.ndarray]], steps: int
) -> list[dict[str, Any]]:
    """cProfile of ``steps`` calls of ``trainer.step``: the top functions by own time."""
    import cProfile
    import pstats

    for b in batches:
        trainer.step(b)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        m = trainer.step(batches[i % len(batches)])
    float(m["loss"])
    prof.disable()
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{fn} ({file.rsplit('/', 2)[-1] if '/' in file else file}:{line})",
                "calls_per_step": nc / steps,
                "own_us_per_step": 1e6 * tt / steps,
                "cumulative_us_per_step": 1e6 * ct / steps,
                "own_share": tt / total if total else 0.0,
            }
        )
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return rows[:12]
