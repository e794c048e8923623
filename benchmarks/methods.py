"""The methods compared, each one a way to run the same training step.

Every method has ``setup()`` (build, move, compile: never timed as a step) and
``block(k) -> seconds``: run ``k`` consecutive training steps and return the wall time
from the first dispatch until the last step's results are ready. Work a method needs
only once per block (building an argument list, writing state back) is outside the
timed region. Batches cycle through the same few host batches for every method.

Imports: torch and torch_xla (only the torch methods use them), jax, stepbundle.runtime.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np


class Method:
    name = ""

    def setup(self) -> None:  # pragma: no cover - interface
        pass

    def block(self, k: int) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


# --------------------------------------------------------------------- torch
class TorchXlaLazy(Method):
    """torch_xla: the user's step traced again on every step, one ``torch_xla.sync()`` each."""

    name = "torch_xla_lazy"

    def __init__(self, case: Any, batches: Sequence[dict[str, np.ndarray]]) -> None:
        self.case, self.batches, self.i = case, batches, 0

    def setup(self) -> None:
        import models
        import torch_xla

        from stepbundle.exporter.workspace import move_to_device

        self.dev = torch_xla.device()
        self.model = models.build_model(self.case)
        self.opt = models.adamw(self.model, for_export=True)
        move_to_device(self.model, self.opt, self.dev)
        self.model.train()
        self.step = models.step_fn(self.case)
        torch_xla.sync()

    def block(self, k: int) -> float:
        import torch
        import torch_xla
        import torch_xla.core.xla_model as xm

        host = [{n: torch.from_numpy(v) for n, v in b.items()} for b in self.batches]
        t0 = time.perf_counter()
        for _ in range(k):
            b = host[self.i % len(host)]
            self.i += 1
            out = self.step(self.model, self.opt, {n: v.to(self.dev) for n, v in b.items()})
            torch_xla.sync()
        xm.wait_device_ops()
        dt = time.perf_counter() - t0
        assert out["loss"].device.type == "xla"
        return dt


class TorchXlaDynamo(TorchXlaLazy):
    """torch_xla's dynamo bridge: ``torch.compile(..., backend="openxla")``.

    ``whole_step``: the whole training step (zero_grad, forward, loss, backward,
    optimizer step) is compiled, torch_xla's own answer to "trace once, replay".
    Otherwise only the model is compiled and backward and the optimizer stay lazy
    tensors, synced every step. Compilation happens in set-up and is never counted.
    """

    def __init__(
        self, case: Any, batches: Sequence[dict[str, np.ndarray]], *, whole_step: bool
    ) -> None:
        super().__init__(case, batches)
        self.whole_step = whole_step
        self.name = "torch_xla_dynamo_step" if whole_step else "torch_xla_dynamo_model"

    def setup(self) -> None:
        import torch
        import torch_xla

        super().setup()
        if self.whole_step:
            plain = self.step
            model, opt = self.model, self.opt

            def whole(batch: dict[str, Any]) -> Any:
                return plain(model, opt, batch)["loss"]

            compiled = torch.compile(whole, backend="openxla")
            self.run = lambda b: compiled(b)
        else:
            compiled_model = torch.compile(self.model, backend="openxla")
            plain = self.step

            def run(b: dict[str, Any]) -> Any:
                out = plain(compiled_model, self.opt, b)["loss"]
                torch_xla.sync()
                return out

            self.run = run
        self.block(3)  # compiles (the first optimizer step creates its state)

    def block(self, k: int) -> float:
        import torch
        import torch_xla.core.xla_model as xm

        host = [{n: torch.from_numpy(v) for n, v in b.items()} for b in self.batches]
        t0 = time.perf_counter()
        for _ in range(k):
            b = host[self.i % len(host)]
            self.i += 1
            loss = self.run({n: v.to(self.dev) for n, v in b.items()})
        float(loss.detach().cpu())
        xm.wait_device_ops()
        return time.perf_counter() - t0


class TorchEager(Method):
    """Plain PyTorch on the CPU, default AdamW (every step synchronous)."""

    name = "torch_eager"

    def __init__(self, case: Any, batches: Sequence[dict[str, np.ndarray]]) -> None:
        self.case, self.batches, self.i = case, batches, 0

    def setup(self) -> None:
        import models

        self.model = models.build_model(self.case)
        self.opt = models.adamw(self.model, for_export=False)
        self.model.train()
        self.step = models.step_fn(self.case)
        self.host = [self._host(b) for b in self.batches]

    @staticmethod
    def _host(b: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch

        return {n: torch.from_numpy(v) for n, v in b.items()}

    def _one(self) -> Any:
        b = self.host[self.i % len(self.host)]
        self.i += 1
        return self.step(self.model, self.opt, b)

    def block(self, k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            out = self._one()
        float(out["loss"].detach())
        return time.perf_counter() - t0


class TorchCompile(TorchEager):
    """``torch.compile`` (inductor, CPU) of the model and of ``optimizer.step``.

    Compilation happens in ``setup`` (its time is reported separately, never as a step).
    """

    name = "torch_compile"
    compile_seconds = 0.0

    def setup(self) -> None:
        import models
        import torch

        torch._dynamo.reset()  # nothing compiled for an earlier case is reused or guarded
        self.model = models.build_model(self.case)
        self.opt = models.adamw(self.model, for_export=False)
        self.model.train()
        compiled = torch.compile(self.model)
        opt = self.opt

        @torch.compile
        def opt_step() -> None:
            opt.step()

        class _Opt:
            zero_grad = opt.zero_grad
            step = staticmethod(opt_step)

        self.step_opt = _Opt()
        self.compiled = compiled
        self.host = [self._host(b) for b in self.batches]
        plain = models.step_fn(self.case)

        def step(model: Any, _opt: Any, batch: Any) -> Any:
            return plain(compiled, self.step_opt, batch)

        self.step = step
        t0 = time.perf_counter()
        # Two steps compile (the first optimizer step creates its state); more settle.
        for _ in range(4):
            out = self._one()
        float(out["loss"].detach())
        self.compile_seconds = time.perf_counter() - t0


# ----------------------------------------------------------------------- jax
class JaxJit(Method):
    """A hand-written ``jax.jit`` step with optax AdamW, everything donated."""

    name = "jax_jit"

    def __init__(self, case: Any, batches: Sequence[dict[str, np.ndarray]]) -> None:
        self.case, self.batches, self.i = case, batches, 0

    def setup(self) -> None:
        import jax_models
        import models

        jax_models.GELU_TANH = models.GELU == "tanh"
        state = {
            k: v.detach().numpy().copy()
            for k, v in models.build_model(self.case).state_dict().items()
        }
        if self.case.name == "mlp":
            self.step, self.carry = jax_models.mlp_step(
                state, self.case.depth, models.LR, models.WEIGHT_DECAY
            )
        else:
            g = self.case.gpt
            self.step, self.carry = jax_models.gpt_step(
                state,
                layers=g.layers,
                heads=g.heads,
                dropout=g.dropout,
                lr=models.LR,
                weight_decay=models.WEIGHT_DECAY,
            )
        self.block(2)

    def block(self, k: int) -> float:
        batches = self.batches
        t0 = time.perf_counter()
        for _ in range(k):
            self.carry, loss = self.step(self.carry, batches[self.i % len(batches)])
            self.i += 1
        float(loss)
        return time.perf_counter() - t0


# ---------------------------------------------------------------- stepbundle
class Stepbundle(Method):
    """``trainer.step(batch)`` with host (numpy) batches: what a user's loop does."""

    name = "stepbundle"

    def __init__(self, trainer: Any, batches: Sequence[dict[str, Any]]) -> None:
        self.trainer, self.batches, self.i = trainer, batches, 0

    def block(self, k: int) -> float:
        tr, batches = self.trainer, self.batches
        t0 = time.perf_counter()
        for _ in range(k):
            m = tr.step(batches[self.i % len(batches)])
            self.i += 1
        float(m["loss"])
        return time.perf_counter() - t0


class StepbundleK(Method):
    """``trainer.run(batches, n)`` on a trainer loaded with ``steps_per_call=K``: K steps
    per PJRT call (host batches, stacked by the trainer for each call). Timed blocks are
    whole calls (``granularity``); a warm-up block of other k runs whole calls and is
    scaled to k steps."""

    def __init__(self, trainer: Any, batches: Sequence[dict[str, Any]], k: int) -> None:
        self.trainer, self.batches, self.k = trainer, list(batches), k
        self.name = f"stepbundle_k{k}"
        self.granularity = k  # timing.measure times whole calls
        # run() takes batches[i % len] for step i: a list of K batches per call.
        self.cycle = [self.batches[i % len(self.batches)] for i in range(k)]

    def block(self, k: int) -> float:
        calls = max(1, round(k / self.k))
        steps = calls * self.k
        t0 = time.perf_counter()
        out = self.trainer.run(self.cycle, steps, keep_metrics=False)
        float(out[-1]["loss"])
        return (time.perf_counter() - t0) * k / steps


class StepbundleDeviceBatch(Stepbundle):
    """Diagnostic: ``trainer.step`` with batches already on the device (no transfer)."""

    name = "stepbundle_devbatch"

    def __init__(self, trainer: Any, batches: Sequence[dict[str, Any]]) -> None:
        import jax

        from stepbundle.runtime import _compat

        dev = trainer.device
        with _compat.x64_scope():  # int64 token ids stay int64, as the bundle expects
            placed = [{n: jax.device_put(v, dev) for n, v in b.items()} for b in batches]
        super().__init__(trainer, placed)


class Floor(Method):
    """A bare loop of the trainer's own executable, dispatched the way the trainer does.

    The same compiled executable and the same dispatch call (``plan.dispatch``: one
    ``execute_sharded`` plus precomputed result handlers), with the batch on the device
    already, no Python checks, and each donated state input replaced by its update
    before the next call. State is borrowed from the trainer for the block and handed
    back after it.
    """

    name = "floor"

    def __init__(self, trainer: Any, batches: Sequence[dict[str, np.ndarray]]) -> None:
        import jax

        from stepbundle.runtime import _compat

        self.trainer = trainer
        plan = trainer._router.plans["train"][0]
        self.plan = plan
        self.exe = plan.dispatch
        dev = trainer.device
        with _compat.x64_scope():
            self.dev_batches = [{n: jax.device_put(v, dev) for n, v in b.items()} for b in batches]
            self.seed = (
                jax.device_put(np.array(1234, dtype=np.int64), dev)
                if plan.seed_slot is not None
                else None
            )
        pos_of_state = {si: pos for pos, si in plan.state_slots}
        # (output position, argument position) for every state update that is fed back.
        self.feed = [(o, pos_of_state[si]) for o, si in plan.update_slots if si in pos_of_state]
        self.feed_outputs = {o for o, _ in self.feed}
        self.loss_slot = plan.loss_slot
        self.hyper = [(pos, trainer._hp.buffer(n)) for pos, n in plan.hyper_slots]
        self.i = 0

    def _args(self, b: dict[str, Any]) -> list[Any]:
        plan = self.plan
        args = plan.template.copy()
        for pos, si in plan.state_slots:
            args[pos] = self.trainer._store.buffers[si]
        for pos, n in plan.batch_slots:
            args[pos] = b[n]
        if plan.seed_slot is not None:
            args[plan.seed_slot] = self.seed
        for pos, buf in self.hyper:
            args[pos] = buf
        return args

    def block(self, k: int) -> float:
        plan, exe, feed = self.plan, self.exe, self.feed
        batches = [[(pos, b[n]) for pos, n in plan.batch_slots] for b in self.dev_batches]
        args = self._args(self.dev_batches[0])
        nb = len(batches)
        i = self.i
        t0 = time.perf_counter()
        for _ in range(k):
            for pos, a in batches[i % nb]:
                args[pos] = a
            outs = exe(args)
            for o, pos in feed:
                args[pos] = outs[o]
            i += 1
        float(np.asarray(outs[self.loss_slot]))
        dt = time.perf_counter() - t0
        self.i = i
        st = self.trainer._store.buffers
        for pos, si in plan.state_slots:
            st[si] = args[pos]
        return dt
