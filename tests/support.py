"""Test harness: train a recipe eagerly with torch_xla, on the CPU, and from a bundle.

Every equivalence test in this repository goes through these functions, so "the same
training three ways" means the same initial state, the same batches and the same
number of steps everywhere.

Imports torch lazily: tests/runtime must stay importable without torch.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.runtime import CompileOptions, LoadOptions

ROOT = Path(__file__).resolve().parent.parent
LEAN_RUNNER = Path(__file__).resolve().parent / "lean_runner.py"


@dataclass
class Run:
    """What a training run produced: per-step metrics and the final state."""

    metrics: list[dict[str, float]]
    state: dict[str, np.ndarray]

    def series(self, name: str) -> np.ndarray:
        return np.array([m[name] for m in self.metrics], dtype=np.float64)


def to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().copy()


def make_batches(recipe: Any, n: int, seed: int = 1234) -> list[dict[str, np.ndarray]]:
    """n batches shaped like the recipe's example batch: the example first, then noise.

    Floating inputs are standard normal, integer inputs are drawn within the example's
    own range (so class labels and token ids stay valid).
    """
    rng = np.random.default_rng(seed)
    ex = {k: to_numpy(v) for k, v in recipe.example_batch.items()}
    out = [ex]
    for _ in range(n - 1):
        b = {}
        for k, v in ex.items():
            if np.issubdtype(v.dtype, np.floating):
                b[k] = rng.standard_normal(v.shape).astype(v.dtype)
            elif v.dtype == np.bool_:
                b[k] = v.copy()
            else:
                lo, hi = int(v.min()), int(v.max())
                b[k] = rng.integers(lo, hi + 1, size=v.shape).astype(v.dtype)
        out.append(b)
    return out


def mse_step(model: Any, optimizer: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The ordinary training step most test recipes export: MSE of ``model(x)`` against
    ``y``, backward, one optimizer step."""
    import torch

    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def save_batches(batches: Sequence[Mapping[str, np.ndarray]], path: Path) -> Path:
    np.savez(path, **{k: np.stack([b[k] for b in batches]) for k in batches[0]})
    return path


def _floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(to_numpy(v).reshape(-1)[0]) for k, v in metrics.items()}


def train_eager_xla(
    recipe_fn: Callable[[], Any],
    batches: Sequence[Mapping[str, np.ndarray]],
    steps: int,
    *,
    seed: int | None = None,
    schedule: Callable[[int], float] | None = None,
) -> Run:
    """Train with torch_xla eagerly: lazy tensors, one sync per step (the reference)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from stepbundle.exporter.workspace import move_to_device, named_state

    dev = torch_xla.device()
    r = recipe_fn()
    move_to_device(r.model, r.optimizer, dev)
    torch_xla.sync()
    if seed is not None:
        xm.set_rng_state(seed)
    metrics = []
    # The modes the recipe left each module in (a frozen BatchNorm stays in eval mode),
    # as the exporter traces them.
    for i in range(steps):
        if schedule is not None:
            for g in r.optimizer.param_groups:
                g["lr"] = schedule(i)
        batch = batches[i % len(batches)]
        b = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in batch.items()}
        out = r.step(r.model, r.optimizer, b)
        torch_xla.sync()
        metrics.append(_floats(out))
    state = {s.name: to_numpy(s.tensor) for s in named_state(r.model, r.optimizer)}
    return Run(metrics, state)


def train_eager_cpu(
    recipe_fn: Callable[[], Any],
    batches: Sequence[Mapping[str, np.ndarray]],
    steps: int,
    *,
    schedule: Callable[[int], float] | None = None,
    float64: bool = False,
) -> Run:
    """Train with plain PyTorch on the CPU.

    ``float64``: the recipe moved to float64 (the model, and every floating batch input),
    the ground truth that float32 implementations are measured against. The optimizer
    must hold no state yet: ``model.double()`` converts the parameters in place, so it
    keeps pointing at them.
    """
    import torch

    from stepbundle.exporter.workspace import named_state

    r = recipe_fn()
    metrics = []
    if float64:
        assert not r.optimizer.state, "float64 needs an optimizer without state"
        r.model.double()
    # The modes the recipe left each module in (a frozen BatchNorm stays in eval mode),
    # as the exporter traces them.
    for i in range(steps):
        if schedule is not None:
            for g in r.optimizer.param_groups:
                g["lr"] = schedule(i)
        b = {
            k: torch.from_numpy(np.ascontiguousarray(batches[i % len(batches)][k]))
            for k in batches[0]
        }
        if float64:
            b = {k: v.double() if v.is_floating_point() else v for k, v in b.items()}
        metrics.append(_floats(r.step(r.model, r.optimizer, b)))
    state = {s.name: to_numpy(s.tensor) for s in named_state(r.model, r.optimizer)}
    return Run(metrics, state)


def run_bundle_lean(
    python: str,
    bundle: Path,
    batches: Sequence[Mapping[str, np.ndarray]],
    steps: int,
    workdir: Path,
    *,
    seed: int | None = None,
    schedule: str | None = None,
    schedule_offset: int = 0,
    require_no_torch: bool = True,
    timeout: float = 300,
) -> Run:
    """Run a bundle in a separate process (normally the lean one, without torch).

    ``schedule`` is a runtime schedule spec for ``lr``; with ``schedule_offset`` K,
    step i uses the schedule's value at step i + K.
    """
    data = save_batches(batches, workdir / f"{bundle.stem}-data.npz")
    out = workdir / f"{bundle.stem}-out.npz"
    cmd = [python, str(LEAN_RUNNER), str(bundle), str(data), str(steps), str(out)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if schedule is not None:
        cmd += ["--schedule", schedule]
        if schedule_offset:
            cmd += ["--schedule-offset", str(schedule_offset)]
    if require_no_torch:
        cmd.append("--require-no-torch")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"runtime process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with np.load(out, allow_pickle=False) as z:
        names = [k[len("metric/") :] for k in z.files if k.startswith("metric/")]
        series = {n: z[f"metric/{n}"] for n in names}
        metrics = [{n: float(series[n][i].reshape(-1)[0]) for n in names} for i in range(steps)]
        state = {k[len("state/") :]: z[k] for k in z.files if k.startswith("state/")}
        assert int(z["info/torch_importable"]) == 0 or not require_no_torch
    return Run(metrics, state)


def run_bundle_inprocess(
    bundle: Path,
    batches: Sequence[Mapping[str, np.ndarray]],
    steps: int,
    *,
    seed: int | None = None,
    schedule: Callable[[int], float] | None = None,
) -> Run:
    from stepbundle.runtime import load

    trainer = load(bundle, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    if seed is not None:
        trainer.seed = seed
    if schedule is not None:
        trainer.set_schedule("lr", schedule)
    ms = trainer.run(list(batches), steps)
    metrics = [
        {k: float(np.asarray(v).astype(np.float64).reshape(-1)[0]) for k, v in m.items()}
        for m in ms
    ]
    state = {k: np.asarray(v) for k, v in trainer.state_dict().items()}
    return Run(metrics, state)


def max_rel_diff(a: np.ndarray, b: np.ndarray, floor: float = 1e-6) -> float:
    """Relative error of ``a`` against the reference ``b``: max|a-b| / max(max|b|, floor).

    This is the infinity-norm relative error of the whole tensor. An elementwise ratio
    would turn rounding noise in elements that cancel to nearly zero into huge numbers;
    measuring against the tensor's own scale does not, and still catches any element
    that is wrong at the tensor's scale. For scalars it is the ordinary relative error.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return float("inf")
    fin = np.isfinite(b)
    if not fin.any():
        return 0.0
    scale = max(float(np.max(np.abs(b[fin]))), floor)
    return float(np.max(np.abs(a[fin] - b[fin]))) / scale


def assert_runs_close(
    got: Run,
    ref: Run,
    *,
    rtol: float,
    atol_floor: float = 1e-6,
    state: bool = True,
    what: str = "",
) -> dict[str, float]:
    """Compare every metric at every step, and (by default) every state tensor.

    Returns the largest relative differences found, for reporting.
    """
    assert len(got.metrics) == len(ref.metrics), what
    worst_metric = 0.0
    for i, (g, r) in enumerate(zip(got.metrics, ref.metrics)):
        assert set(g) == set(r), f"{what} step {i}: metrics {sorted(g)} vs {sorted(r)}"
        for k in r:
            d = max_rel_diff(np.array(g[k]), np.array(r[k]), atol_floor)
            worst_metric = max(worst_metric, d)
            assert d <= rtol, (
                f"{what} step {i} metric {k}: {g[k]!r} vs {r[k]!r} (rel {d:.3g} > {rtol})"
            )
    worst_state = 0.0
    if state:
        # Gradients that the step throws away and rebuilds every time (the usual
        # zero_grad(set_to_none=True) before backward) are not state of a bundle;
        # every other tensor of the reference must be there.
        missing = {k for k in set(ref.state) - set(got.state) if not k.endswith(".grad")}
        assert not missing, f"{what}: state missing from the bundle run: {sorted(missing)[:10]}"
        for k, v in ref.state.items():
            if k not in got.state:
                continue
            d = max_rel_diff(got.state[k], v, atol_floor)
            worst_state = max(worst_state, d)
            assert d <= rtol, f"{what} state {k}: rel diff {d:.3g} > {rtol}"
    return {"metric": worst_metric, "state": worst_state}


def export_recipe(recipe_fn: Callable[[], Any], path: Path, **kwargs: Any) -> Any:
    from stepbundle.exporter import export

    return export(recipe_fn(), path, **kwargs)


def python_has_no_torch(python: str) -> bool:
    proc = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    return proc.returncode != 0 and "No module named 'torch'" in proc.stderr


__all__ = [
    "Run",
    "assert_runs_close",
    "export_recipe",
    "make_batches",
    "max_rel_diff",
    "python_has_no_torch",
    "run_bundle_inprocess",
    "run_bundle_lean",
    "save_batches",
    "train_eager_cpu",
    "train_eager_xla",
]
