"""Held-out training steps (issue #15): export, run 3 steps, compare with torch_xla eager.

For every case of ``benchmarks/heldout_cases.py`` a child process (so one crash or one
torch_xla state cannot spoil the next case):

1. exports one ordinary training step from a fresh optimizer with ``stepbundle.exporter.export``
   (the time is measured after every import);
2. runs the bundle for 3 steps with the runtime (``stepbundle.runtime.load``, in-process);
3. runs the same recipe in torch_xla eager for 3 steps with the same RNG seed;
4. for the cases in ``FLOAT64``: the dropout-free variant three more ways (bundle, torch_xla
   eager, PyTorch float64 on the CPU), to tell which side of a state gap is right.

Distances: loss ``|a-b|/|b|`` (worst step); state ``||a-b|| / ||b||`` per tensor (worst
tensor, named, with its ``max|a-b|`` and ``||b||`` so that a near-zero tensor is seen as such).

Usage (timm and peft outside the venv, only for this script)::

    pip install --no-deps --target /tmp/heldout-site timm peft accelerate
    PYTHONPATH=/tmp/heldout-site .venv/bin/python benchmarks/heldout.py \\
        --out benchmarks/results/heldout.json
    .venv/bin/python benchmarks/heldout.py --one "HF GPT-2 (tiny)"    # one case, JSON on stdout

Imports: torch, torch_xla, the exporter and the runtime; tests/support.py for the loops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
os.environ.setdefault("PJRT_DEVICE", "CPU")

STEPS = 3
FLOAT64 = {
    "torchvision efficientnet_b0 (stochastic depth)",
    "torchvision ViT (2 layers)",
    "HF BERT (tiny, eager attention)",
    "nn.TransformerEncoder",
    "torchvision mobilenet_v3_small",
    "timm resnet10t",
}


def normwise(got: np.ndarray, ref: np.ndarray) -> float:
    g, r = np.asarray(got, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    num = float(np.linalg.norm(g - r))
    den = float(np.linalg.norm(r))
    return 0.0 if num == 0.0 else (num / den if den > 0 else float("inf"))


def compare(got: Any, ref: Any) -> dict[str, Any]:
    loss = max(
        abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got.metrics, ref.metrics)
    )
    per = {
        k: normwise(got.state[k], v)
        for k, v in ref.state.items()
        if k in got.state and v.dtype.kind == "f"
    }
    worst = max(per, key=lambda k: per[k])
    g, r = np.asarray(got.state[worst], np.float64), np.asarray(ref.state[worst], np.float64)
    top = sorted(per.items(), key=lambda kv: -kv[1])[:5]
    return {
        "loss": loss,
        "state": per[worst],
        "tensor": worst,
        "abs": float(np.max(np.abs(g - r))),
        "ref_norm": float(np.linalg.norm(r)),
        "ref_max": float(np.max(np.abs(r))),
        "top": top,
        "per": per,
    }


def run_bundle(path: Path, batches: Any, out: dict[str, Any]) -> Any:
    """The bundle with the recipe's seed; without one where the bundle has no seed input
    (the dropout-free variants draw none)."""
    from heldout_cases import SEED
    from support import run_bundle_inprocess

    from stepbundle.runtime.errors import BindingError

    try:
        return run_bundle_inprocess(path, batches, STEPS, seed=SEED)
    except BindingError as e:
        out.setdefault("notes", []).append(str(e).splitlines()[0])
        return run_bundle_inprocess(path, batches, STEPS)


def on_cpu(recipe: Any) -> Any:
    """torch refuses a capturable step on the CPU; the non-capturable update is the same math."""
    for g in recipe.optimizer.param_groups:
        if g.get("capturable"):
            g["capturable"] = False
    return recipe


def one(name: str) -> dict[str, Any]:
    import torch  # noqa: F401
    import torch_xla  # noqa: F401
    from heldout_cases import CASES, NO_FLOAT64, SEED
    from support import make_batches, train_eager_cpu, train_eager_xla

    from stepbundle.exporter import export

    if "timm" in name:
        import timm  # noqa: F401
    if "peft" in name:
        import peft  # noqa: F401
    import transformers  # noqa: F401

    make = CASES[name]
    out: dict[str, Any] = {"case": name}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "b.stepbundle"
        t = time.perf_counter()
        try:
            export(make(True), path)
        except Exception as e:  # the refusal is the result
            out["exported"] = False
            out["refusal"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            out["refusal_full"] = str(e)[:3000]
            out["export_s"] = time.perf_counter() - t
            return out
        out["exported"] = True
        out["export_s"] = time.perf_counter() - t
        batches = make_batches(make(True), STEPS)
        bundle = run_bundle(path, batches, out)
        xla = train_eager_xla(lambda: make(True), batches, STEPS, seed=SEED)
        c = compare(bundle, xla)
        c.pop("per")
        out["vs_xla"] = c
        if name in FLOAT64 and name not in NO_FLOAT64:
            p2 = Path(tmp) / "nodrop.stepbundle"
            export(make(False), p2)
            b2 = run_bundle(p2, batches, {})
            x2 = train_eager_xla(lambda: make(False), batches, STEPS, seed=SEED)
            f64 = train_eager_cpu(lambda: on_cpu(make(False)), batches, STEPS, float64=True)
            bx, bf, xf = compare(b2, x2), compare(b2, f64), compare(x2, f64)
            # The tensor behind the bundle/torch_xla gap, seen from float64.
            k = bx["tensor"]
            out["nodrop"] = {
                "bundle_vs_xla": {x: bx[x] for x in bx if x != "per"},
                "bundle_vs_f64": {x: bf[x] for x in bf if x != "per"},
                "xla_vs_f64": {x: xf[x] for x in xf if x != "per"},
                "gap_tensor": k,
                "gap_tensor_bundle_vs_f64": bf["per"].get(k),
                "gap_tensor_xla_vs_f64": xf["per"].get(k),
                "gap_tensor_f64_norm": float(np.linalg.norm(f64.state[k].astype(np.float64))),
                "gap_tensor_abs_bundle_f64": float(
                    np.max(np.abs(b2.state[k].astype(np.float64) - f64.state[k]))
                ),
                "gap_tensor_abs_xla_f64": float(
                    np.max(np.abs(x2.state[k].astype(np.float64) - f64.state[k]))
                ),
            }
    return out


def _cell(c: dict[str, Any]) -> str:
    return f"{c['state']:.1e} ({c['tensor']}; max abs {c['abs']:.1e}, ref norm {c['ref_norm']:.1e})"


def render(results: list[dict[str, Any]], command: str) -> str:
    lines = [
        f"Held-out training steps (issue #15), {STEPS} steps each, bundle (runtime in .venv) "
        "against torch_xla 2.9 eager with the same RNG seed.",
        "",
        f"Made by: `{command}`",
        "",
        "| case | exported | worst loss diff (rel) | worst state diff (normwise; tensor) | "
        "export s |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("exported"):
            c = r["vs_xla"]
            lines.append(
                f"| {r['case']} | yes | {c['loss']:.1e} | {_cell(c)} | {r['export_s']:.1f} |"
            )
        elif r.get("exported") is False:
            lines.append(f"| {r['case']} | no: {r['refusal']} | | | {r['export_s']:.1f} |")
        else:
            lines.append(f"| {r['case']} | crashed: {r['crash']} | | | |")
    lines += [
        "",
        "Float64 column: the dropout-free variant of each case, trained by the bundle, "
        "torch_xla eager and PyTorch float64 on the CPU (the ground truth).",
        "",
        "| case | bundle vs xla | bundle vs f64 (worst) | xla vs f64 (worst) | gap tensor: "
        "bundle vs f64 | gap tensor: xla vs f64 | gap tensor: max abs bundle/xla vs f64, "
        "f64 norm |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        d = r.get("nodrop")
        if not d:
            continue
        lines.append(
            f"| {r['case']} | {_cell(d['bundle_vs_xla'])} | {_cell(d['bundle_vs_f64'])} "
            f"| {_cell(d['xla_vs_f64'])} | {d['gap_tensor_bundle_vs_f64']:.1e} "
            f"| {d['gap_tensor_xla_vs_f64']:.1e} | {d['gap_tensor_abs_bundle_f64']:.1e} / "
            f"{d['gap_tensor_abs_xla_f64']:.1e}, {d['gap_tensor_f64_norm']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one", help="run one case in this process, print its JSON")
    ap.add_argument("--only", help="comma-separated substrings: run the matching cases")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "heldout.json")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--render", type=Path, help="write the markdown table from --out's JSON")
    ap.add_argument("--also", type=Path, nargs="*", default=[], help="reruns replacing cases")
    args = ap.parse_args()
    if args.render:
        results = json.loads(args.out.read_text())
        for extra in args.also:
            again = {r["case"]: r for r in json.loads(extra.read_text())}
            results = [again.get(r["case"], r) for r in results]
        cmd = "PYTHONPATH=/tmp/heldout-site .venv/bin/python benchmarks/heldout.py"
        args.render.write_text(render(results, cmd))
        return
    if args.one:
        print("HELDOUT " + json.dumps(one(args.one)), flush=True)
        return
    from heldout_cases import CASES

    names = list(CASES)
    if args.only:
        names = [n for n in names if any(s in n for s in args.only.split(","))]
    results = []
    for n in names:
        t = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--one", n],
                capture_output=True, text=True, timeout=args.timeout,
            )  # fmt: skip
            line = next((x for x in proc.stdout.splitlines() if x.startswith("HELDOUT ")), None)
            if line is None:
                tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
                r = {"case": n, "exported": None, "crash": tail[0][:300]}
            else:
                r = json.loads(line[len("HELDOUT ") :])
        except subprocess.TimeoutExpired:
            r = {"case": n, "exported": None, "crash": f"timed out after {args.timeout} s"}
        r["wall_s"] = time.perf_counter() - t
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "refusal_full"}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
