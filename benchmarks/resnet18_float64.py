"""resnet18 against PyTorch float64: how near each implementation trains to the ground truth.

Issue #16's done-when: torchvision's resnet18 (random init, 64x64 images, batch 8, SGD
momentum 0.9 nesterov, lr 0.01, weight decay 5e-4), 4 steps. Trains it five ways from
the same initial state and the same batches:

- ``f64``: PyTorch on the CPU in float64, the ground truth;
- ``f32``: PyTorch on the CPU in float32;
- ``xla``: torch_xla 2.9 eagerly (CPU);
- ``bundle``: the default export (``numerics="pytorch"``) run by the lean runtime
  (newest jax, no torch);
- ``bundle-xla``: the export with ``numerics="torch_xla"`` run by the lean runtime;

and prints, for each, the worst relative loss difference over the steps and every
state tensor's normwise relative difference ``||got - f64|| / ||f64||``. The done-when
holds when the bundle is within 1e-4 on every loss and within 1e-4 on every tensor where
``f32`` is (tensors whose float64 gradient is exactly zero are skipped and listed).

Usage::

    .venv/bin/python benchmarks/resnet18_float64.py                 # 4 steps, prints a table
    .venv/bin/python benchmarks/resnet18_float64.py --steps 1       # step-0 gradients
    .venv/bin/python benchmarks/resnet18_float64.py --out build/resnet18_float64.md

Imports: torch, torch_xla and the exporter; tests/support.py for the training loops
(the equivalence suite's own), the lean environment's python for the bundles.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("PJRT_DEVICE", "CPU")

from support import (  # noqa: E402
    Run,
    export_recipe,
    make_batches,
    run_bundle_lean,
    train_eager_cpu,
    train_eager_xla,
)

BOUND = 1e-4
LEAN = ROOT / ".venv-lean" / "bin" / "python"


def classify(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
    import torch

    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def recipe(numerics: str = "pytorch", lr: float = 0.01, weight_decay: float = 5e-4) -> Any:
    import torch
    import torchvision

    from stepbundle.exporter import Recipe

    torch.manual_seed(6)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    opt = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay
    )
    g = torch.Generator().manual_seed(7)
    return Recipe(
        model=model,
        optimizer=opt,
        step=classify,
        example_batch={"x": torch.randn(8, 3, 64, 64, generator=g), "y": torch.arange(8) % 10},
        numerics=numerics,
    )


def normwise(got: np.ndarray, ref: np.ndarray) -> float:
    g, r = np.asarray(got, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    num = float(np.linalg.norm(g - r))
    den = float(np.linalg.norm(r))
    return 0.0 if num == 0.0 else (num / den if den > 0 else float("inf"))


PERTURBATION = 1e-7
"""``f64-perturbed``: float64 from weights multiplied by 1 + 1e-7 N(0, 1), about one
float32 rounding: how far exact arithmetic itself moves from rounding-sized changes."""


def perturbed(recipe_fn: Any, eps: float) -> Any:
    def make() -> Any:
        import torch

        r = recipe_fn()
        g = torch.Generator().manual_seed(99)
        with torch.no_grad():
            r.model.double()
            for p in r.model.parameters():
                p.mul_(1 + eps * torch.randn(p.shape, generator=g, dtype=torch.float64))
        return r

    return make


def loss_diffs(run: Run, ref: Run) -> list[float]:
    return [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(run.metrics, ref.metrics)]


def train_all(
    steps: int, which: list[str], lr: float, wd: float, n_batches: int = 4
) -> dict[str, Run]:
    runs: dict[str, Run] = {}
    batches = make_batches(recipe(), n_batches)
    times: dict[str, float] = {}

    def rec(numerics: str = "pytorch") -> Any:
        return lambda: recipe(numerics, lr, wd)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in which:
            t = time.perf_counter()
            if name == "f64":
                runs[name] = train_eager_cpu(rec(), batches, steps, float64=True)
            elif name == "f32":
                runs[name] = train_eager_cpu(rec(), batches, steps)
            elif name == "f32-native":
                import torch

                # PyTorch's own convolution kernels instead of oneDNN's.
                torch.backends.mkldnn.enabled = False
                try:
                    runs[name] = train_eager_cpu(rec(), batches, steps)
                finally:
                    torch.backends.mkldnn.enabled = True
            elif name == "f64-perturbed":
                runs[name] = train_eager_cpu(
                    perturbed(rec(), PERTURBATION), batches, steps, float64=True
                )
            elif name == "xla":
                runs[name] = train_eager_xla(rec(), batches, steps)
            else:
                numerics = "torch_xla" if name == "bundle-xla" else "pytorch"
                path = work / f"{name}.stepbundle"
                export_recipe(rec(numerics), path)
                sub = work / name
                sub.mkdir()
                runs[name] = run_bundle_lean(str(LEAN), path, batches, steps, sub, timeout=900)
            times[name] = time.perf_counter() - t
            print(f"# {name}: {times[name]:.1f} s", file=sys.stderr, flush=True)
    return runs


RUNS = ("f32", "f32-native", "xla", "bundle", "bundle-xla", "f64-perturbed")


def _zero_grad_params(ref: Run) -> list[str]:
    return sorted(
        k[: -len(".grad")] for k, v in ref.state.items() if k.endswith(".grad") and not np.any(v)
    )


def _belongs(name: str, params: list[str]) -> bool:
    """``name`` is one of ``params`` or state built from it (its grad, its momentum)."""
    return any(name in (p, f"{p}.grad") or name.startswith(f"optimizer.state.{p}.") for p in params)


def report(runs: dict[str, Run], steps: int, lr: float, wd: float, n_batches: int) -> str:
    ref = runs["f64"]
    others = [k for k in RUNS if k in runs]
    zero_grad = _zero_grad_params(ref)
    lines = [
        f"resnet18, 64x64, batch 8, SGD nesterov lr {lr} wd {wd}, {steps} step(s), "
        f"{n_batches} distinct batch(es); distances to PyTorch float64 (CPU)",
        "",
        "| run | worst loss (relative) | losses per step | worst tensor (normwise), "
        "running_var aside | where | tensors > 1e-4 where f32 <= 1e-4 (running_var aside) "
        "| worst running_var |",
        "|---|---|---|---|---|---|---|",
    ]
    per_tensor: dict[str, dict[str, float]] = {}
    # The done-when's reference is PyTorch float32 with its own kernels when it ran
    # (f32-native), else with oneDNN's.
    f32_ref = "f32-native" if "f32-native" in runs else "f32"
    for k in others:
        run = runs[k]
        ld = loss_diffs(run, ref)
        d = {
            n: normwise(run.state[n], ref.state[n])
            for n in ref.state
            if n in run.state and ref.state[n].dtype.kind == "f"
        }
        per_tensor[k] = d
        plain = {n: v for n, v in d.items() if not n.endswith("running_var")}
        rv = max((v for n, v in d.items() if n.endswith("running_var")), default=0.0)
        worst = max(plain, key=lambda n: plain[n])
        f32 = per_tensor.get(f32_ref, plain)
        bad = sorted(
            n
            for n in plain
            if plain[n] > BOUND and f32.get(n, 1.0) <= BOUND and not _belongs(n, zero_grad)
        )
        lines.append(
            f"| {k} | {max(ld):.2e} | {', '.join(f'{x:.1e}' for x in ld)} | {plain[worst]:.2e} "
            f"| {worst} | {len(bad)}{(': ' + ', '.join(bad[:6])) if bad else ''} | {rv:.1e} |"
        )
    lines += [
        "",
        f"Parameters whose float64 gradient is exactly zero (skipped): {zero_grad or 'none'}.",
        "",
    ]
    names = sorted(ref.state, key=lambda n: -max(per_tensor[k].get(n, 0.0) for k in others))
    lines += ["| tensor | " + " | ".join(others) + " |", "|---" * (len(others) + 1) + "|"]
    for n in names:
        if ref.state[n].dtype.kind != "f":
            continue
        cells = " | ".join(f"{per_tensor[k][n]:.1e}" if n in per_tensor[k] else "-" for k in others)
        lines.append(f"| {n} | {cells} |")
    return "\n".join(lines) + "\n"


def bisect(steps: int, n_batches: int, lr: float, wd: float) -> str:
    """Which op's float32 rounding moves the trajectory: float64 training with one kind of
    module (BatchNorm, convolution, max-pool, linear, the loss) computed in float32
    (inputs cast down, result cast up; autograd runs that op's backward in float32 too),
    with PyTorch's native kernels (oneDNN off) and with oneDNN's."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class In32(nn.Module):
        def __init__(self, m: nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: Any) -> Any:
            m = self.m
            x = x.float()
            if isinstance(m, nn.BatchNorm2d):
                w, b = m.weight.float(), m.bias.float()
                y = F.batch_norm(x, None, None, w, b, True, 0.1, m.eps)
            elif isinstance(m, nn.Conv2d):
                y = F.conv2d(x, m.weight.float(), None, m.stride, m.padding, m.dilation, m.groups)
            elif isinstance(m, nn.Linear):
                y = F.linear(x, m.weight.float(), m.bias.float())
            else:
                y = m(x)
            return y.double()

    kinds = {"BatchNorm": nn.BatchNorm2d, "conv": nn.Conv2d, "max-pool": nn.MaxPool2d}
    kinds["linear"] = nn.Linear
    batches = make_batches(recipe(), n_batches)

    def train(kind: str) -> list[float]:
        r = recipe(lr=lr, weight_decay=wd)
        r.model.double()
        for m in list(r.model.modules()):
            for cname, child in list(m.named_children()):
                types = tuple(kinds.values()) if kind == "all" else kinds.get(kind, ())
                if types and isinstance(child, types):
                    setattr(m, cname, In32(child))
        out = []
        for i in range(steps):
            b = batches[i % n_batches]
            x, y = torch.from_numpy(b["x"]).double(), torch.from_numpy(b["y"])
            r.optimizer.zero_grad()
            logits = r.model(x)
            if kind in ("loss", "all"):
                loss = F.cross_entropy(logits.float(), y).double()
            else:
                loss = F.cross_entropy(logits, y)
            loss.backward()
            r.optimizer.step()
            out.append(float(loss))
        return out

    lines = [
        "| in float32 (the rest float64) | convolutions by | losses per step, relative to "
        "float64 |",
        "|---|---|---|",
    ]
    for mkldnn in (False, True):
        torch.backends.mkldnn.enabled = mkldnn
        ref = train("none")
        for kind in [*kinds, "loss", "all"]:
            got = train(kind)
            cells = ", ".join(f"{abs(a - c) / abs(c):.1e}" for a, c in zip(got, ref))
            lines.append(f"| {kind} | {'oneDNN' if mkldnn else 'PyTorch native'} | {cells} |")
    torch.backends.mkldnn.enabled = True
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--batches", type=int, default=4, help="distinct batches (step i: i % n)")
    ap.add_argument("--runs", default="f64,f32,xla,bundle,bundle-xla")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--top", type=int, default=40, help="tensors printed (all go to --out)")
    ap.add_argument("--bisect", action="store_true", help="float64 with one op in float32")
    args = ap.parse_args()
    if args.bisect:
        print(bisect(args.steps, args.batches, args.lr, args.weight_decay))
        return
    which = args.runs.split(",")
    # torch_xla (eager or exporting) first: its autograd engine cannot start after the
    # CPU's has run (an internal assert on the device index), as in the equivalence harness.
    which = sorted(which, key=lambda w: w.startswith("f"))
    runs = train_all(args.steps, which, args.lr, args.weight_decay, args.batches)
    text = report(runs, args.steps, args.lr, args.weight_decay, args.batches)
    head = text.split("\n")
    cut = next(i for i, line in enumerate(head) if line.startswith("| tensor |"))
    print("\n".join(head[: cut + 2 + args.top]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
