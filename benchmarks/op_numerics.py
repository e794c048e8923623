"""Which ops torch_xla lowers to numerically weak forms: a survey against PyTorch float64.

Issue #16 asks, beyond training BatchNorm, about variance and ``std``, ``log_softmax`` /
``logsumexp``, ``layer_norm``, ``group_norm`` and ``cross_entropy`` with label smoothing.
Each op runs on an adversarial float32 input (a large mean against a small spread for the
statistics, large and widely spread logits for the softmax family) five ways:

- ``f64``: PyTorch on the CPU in float64 (the input converted exactly), the ground truth;
- ``f32``: PyTorch on the CPU in float32;
- ``xla``: torch_xla 2.9 eagerly (CPU), the op as torch_xla lowers it;
- ``bundle``: a one-op training step exported with the default numerics
  (``numerics="pytorch"``) and run by the lean runtime (newest jax, no torch);
- ``bundle-xla``: the same exported with ``numerics="torch_xla"``.

For each, the normwise relative error ``||got - f64|| / ||f64||`` of the op's output and of
its input gradient (under a fixed random upstream gradient). The bundle's step holds the
input as a parameter and writes the output into a buffer; SGD with momentum 0.9 and lr 0
leaves the gradient in the momentum buffer and the input unchanged.

Usage::

    .venv/bin/python benchmarks/op_numerics.py                     # prints the table
    .venv/bin/python benchmarks/op_numerics.py --out build/op_numerics.md

Imports: torch, torch_xla and the exporter; tests/support.py for the lean runner.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("PJRT_DEVICE", "CPU")

from support import export_recipe, run_bundle_lean  # noqa: E402

LEAN = ROOT / ".venv-lean" / "bin" / "python"


def _cases() -> dict[str, tuple[Callable[[Any], Any], np.ndarray, str]]:
    """name -> (op on a tensor, float32 input, what is adversarial about the input)."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)

    def shifted(shape: tuple[int, ...], mean: float, std: float = 1.0) -> np.ndarray:
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    def labels(n: int, c: int) -> Any:
        return torch.arange(n) % c

    big = "mean 1e3, std 1"
    logits = "logits N(0, 30^2) + 1e3"
    return {
        "var (last dim)": (lambda x: x.var(dim=-1), shifted((16, 512), 1e3), big),
        "var (all, unbiased=False)": (
            lambda x: x.var(unbiased=False).reshape(1),
            shifted((64, 256), 1e3),
            big,
        ),
        "std (last dim)": (lambda x: x.std(dim=-1), shifted((16, 512), 1e3), big),
        "var_mean (dim 0)": (
            lambda x: torch.cat(torch.var_mean(x, dim=0)),
            shifted((512, 16), 1e3),
            big,
        ),
        "layer_norm (affine)": (
            lambda x: F.layer_norm(
                x,
                (x.shape[-1],),
                torch.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype),
                torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype),
            ),
            shifted((32, 256), 1e3),
            big,
        ),
        "group_norm (4 groups)": (lambda x: F.group_norm(x, 4), shifted((8, 32, 8, 8), 1e3), big),
        "log_softmax": (lambda x: F.log_softmax(x, -1), shifted((16, 1000), 1e3, 30.0), logits),
        "logsumexp": (lambda x: torch.logsumexp(x, -1), shifted((16, 1000), 1e3, 30.0), logits),
        "softmax": (lambda x: F.softmax(x, -1), shifted((16, 1000), 1e3, 30.0), logits),
        "cross_entropy, label_smoothing 0.1": (
            lambda x: F.cross_entropy(
                x, labels(x.shape[0], x.shape[1]), label_smoothing=0.1
            ).reshape(1),
            shifted((16, 1000), 1e3, 30.0),
            logits,
        ),
        "cross_entropy, label_smoothing 0.1 (small spread)": (
            lambda x: F.cross_entropy(
                x, labels(x.shape[0], x.shape[1]), label_smoothing=0.1
            ).reshape(1),
            shifted((16, 1000), 1e3, 0.01),
            "logits N(0, 0.01^2) + 1e3",
        ),
    }


def _upstream(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32)


def _eager(op: Callable[[Any], Any], x: np.ndarray, dtype: Any, device: Any) -> tuple[Any, Any]:
    import torch

    t = torch.from_numpy(x).to(dtype).to(device).requires_grad_(True)
    y = op(t)
    g = torch.from_numpy(_upstream(tuple(y.shape))).to(dtype).to(device)
    (gx,) = torch.autograd.grad(y, t, g)
    return y.detach().cpu().double().numpy(), gx.detach().cpu().double().numpy()


def _xla(op: Callable[[Any], Any], x: np.ndarray) -> tuple[Any, Any]:
    import torch
    import torch_xla

    dev = torch_xla.device()

    def on_dev(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(t: Any) -> Any:
            # Ops building constants on the host (labels, affine weights) get them moved.
            with torch.device(dev):
                return fn(t)

        return run

    out = _eager(on_dev(op), x, torch.float32, dev)
    torch_xla.sync()
    return out


def _recipe(op: Callable[[Any], Any], x: np.ndarray, numerics: str) -> Callable[[], Any]:
    import torch
    from torch import nn

    from stepbundle.exporter import Recipe

    with torch.no_grad():
        y_shape = tuple(op(torch.from_numpy(x)).shape)
    up = _upstream(y_shape)

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = nn.Parameter(torch.from_numpy(x.copy()))
            self.register_buffer("up", torch.from_numpy(up.copy()))
            self.register_buffer("out", torch.zeros(y_shape))

    def step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
        optimizer.zero_grad()
        dev = model.x.device
        with torch.device(dev):
            y = op(model.x)
        loss = (y * model.up).sum() + 0 * batch["b"].sum()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            model.out.copy_(y)
        return {"loss": loss}

    def make() -> Any:
        model = One()
        opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
        return Recipe(
            model=model,
            optimizer=opt,
            step=step,
            example_batch={"b": torch.zeros(1)},
            numerics=numerics,
        )

    return make


def _bundle(
    op: Callable[[Any], Any], x: np.ndarray, numerics: str, work: Path, tag: str
) -> tuple[Any, Any]:
    path = work / f"{tag}.stepbundle"
    report = export_recipe(_recipe(op, x, numerics), path)
    sub = work / tag
    sub.mkdir()
    run = run_bundle_lean(str(LEAN), path, [{"b": np.zeros(1, np.float32)}], 1, sub)
    grad = run.state["optimizer.state.x.momentum_buffer"]
    return (run.state["out"].astype(np.float64), grad.astype(np.float64), report.numerics_rewrites)


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    den = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(np.asarray(got) - ref))
    return 0.0 if num == 0 else (num / den if den else float("inf"))


def survey() -> str:
    import torch

    cases = _cases()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # torch_xla before any CPU backward (its autograd engine cannot start after).
        xla = {name: _xla(op, x) for name, (op, x, _) in cases.items()}
        bundles = {}
        for i, (name, (op, x, _)) in enumerate(cases.items()):
            bundles[name] = (
                _bundle(op, x, "pytorch", work, f"c{i}-pytorch"),
                _bundle(op, x, "torch_xla", work, f"c{i}-torch-xla"),
            )
            print(f"# {name}", file=sys.stderr, flush=True)
        for name, (op, x, why) in cases.items():
            ref = _eager(op, x, torch.float64, "cpu")
            f32 = _eager(op, x, torch.float32, "cpu")
            (b_out, b_grad, rewrites), (bx_out, bx_grad, _) = bundles[name]
            runs = [f32, xla[name], (b_out, b_grad), (bx_out, bx_grad)]
            cells = " | ".join(f"{_rel(o, ref[0]):.1e} / {_rel(g, ref[1]):.1e}" for o, g in runs)
            rows.append(f"| {name} | {why} | {cells} | {rewrites} |")
    head = (
        "Normwise relative error against PyTorch float64, output / input gradient.\n\n"
        "| op | input | PyTorch f32 | torch_xla eager | bundle (pytorch numerics) | "
        "bundle (torch_xla numerics) | ops rewritten |\n|---|---|---|---|---|---|---|"
    )
    return head + "\n" + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    text = survey()
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
