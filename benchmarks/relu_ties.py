"""Why the export check refused resnet18 on an AVX-512 host (issue #39 item 5): a ReLU
input within float32's reach of zero, decided one way by PyTorch and the other by XLA.

The export check's resnet18 (benchmarks/export_check.py's recipe: torchvision resnet18,
10 classes, 8 images of 64x64, SGD momentum 0.9, torch.manual_seed(0)) was refused on a
Zen 4 host: one BatchNorm weight's first-step gradient was -0.0036827 in the runtime's
step and 0.00063129 in PyTorch. This script measures what decides it, in two stages:

- ``torch`` (.venv-torch; .venv with ``--frontend torch_xla``): exports the bundle with
  the torch front-end (or torch_xla's) and steps PyTorch once in float64 and in float32,
  recording every ReLU's input; for the ReLU inputs of
  smallest magnitude in float64 (the ties) it steps float64 again with that one ReLU
  decided the other way. Then the same for other seeds: how often PyTorch float32 itself
  decides a ReLU otherwise than float64, and what that does to the gradients.
- ``runtime`` (.venv-lean for jax 0.10.2, .venv for 0.7.1): the bundle's step through the
  runtime under several ``XLA_FLAGS``, each in a fresh process (XLA reads them once). Its
  gradients are compared with PyTorch float64's and with the flipped-tie float64 steps.
  On jaxlib >= 0.10 it also reads the step's own ReLU inputs: the train program as XLA
  holds it before its optimization barriers are removed (``--xla_dump_hlo_pass_re``)
  gets every ``maximum(x, 0)``'s ``x`` appended to its results, is compiled again in the
  same process and run on the same arguments (how far its own results then are from
  the runtime step's is said: the appended results change XLA's fusions).

Usage::

    .venv-torch/bin/python benchmarks/relu_ties.py torch build/relu_ties --out R.md
    .venv-lean/bin/python benchmarks/relu_ties.py runtime build/relu_ties --out R.md
    .venv/bin/python benchmarks/relu_ties.py runtime build/relu_ties --out R.md \\
        --flags= --flags='--xla_backend_optimization_level=0 --xla_cpu_max_isa=AVX2' ...

Imports: torch, torchvision and the torch front-end (torch); stepbundle.runtime and jax
(runtime).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TIES = 3
"""How many of float64's smallest ReLU inputs get a flipped float64 step."""
DEFAULT_FLAGS = (
    "",
    "--xla_cpu_max_isa=AVX2",
    "--xla_cpu_max_isa=AVX",
    "--xla_cpu_max_isa=SSE4_2",
    "STEPBUNDLE_CPU_BLOCKED_SUMS=0",
    "per-compile:xla_cpu_max_isa=AVX2",
)


def _heading(command: str, jax_version: str) -> str:
    simd = "no AVX2"
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        simd = "AVX-512" if " avx512f" in info else ("AVX2" if " avx2" in info else simd)
        for line in info.splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"### `{command}`\n\n"
        f"Host: {platform.machine()}, {os.cpu_count()} cores ({model}, {simd}); "
        f"{jax_version}.\n"
    )


# ---------------------------------------------------------------- torch


def _model_and_batch(seed: int) -> tuple[Any, dict[str, Any]]:
    """export_check.py's resnet18 recipe, drawn from ``seed`` in the same order."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=10)
    batch = {"x": torch.randn(8, 3, 64, 64), "y": torch.randint(0, 10, (8,))}
    return model, batch


def _step(
    model: Any,
    batch: dict[str, Any],
    dtype: Any,
    *,
    channels_last: bool = False,
    flip: tuple[int, int] | None = None,
    upstream: list[Any] | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """One forward and backward of a copy of ``model`` in ``dtype``: every ReLU call's
    input (NCHW, float64) and every parameter's gradient (float64). ``flip`` (call,
    flat index) negates that one ReLU input, so the ReLU decides it the other way (its
    value moves by twice a tie's size: a few 1e-6). ``upstream``, when given, receives
    each call's gradient at its output (float64), in call order: what an open ReLU
    passes on at an element, and a closed one drops."""
    import copy

    import torch

    class Tap(torch.autograd.Function):
        """The identity (a copy), whose backward keeps the gradient at the ReLU's output."""

        @staticmethod
        def forward(ctx: Any, x: Any, k: int) -> Any:  # noqa: ARG004
            ctx.k = k
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            assert upstream is not None
            upstream[ctx.k] = g.detach().double().clone()
            return g, None

    m = copy.deepcopy(model).to(dtype)
    m.train()
    seen: list[Any] = []

    def pre(_mod: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        k = len(seen)
        seen.append(args[0].detach().double().clone())
        x = args[0]
        if flip is not None and flip[0] == k:
            delta = torch.zeros_like(x).reshape(-1)
            delta[flip[1]] = -2 * x.detach().reshape(-1)[flip[1]]
            x = x + delta.reshape(x.shape)
        return (x,) if x is not args[0] else None

    def post(_mod: Any, _args: tuple[Any, ...], out: Any) -> Any:
        if upstream is None:
            return None
        upstream.append(None)
        return Tap.apply(out, len(upstream) - 1)

    relus = [mod for mod in m.modules() if isinstance(mod, torch.nn.ReLU)]
    hooks = [mod.register_forward_pre_hook(pre) for mod in relus]
    hooks += [mod.register_forward_hook(post) for mod in relus]
    x = batch["x"].to(dtype)
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    loss = torch.nn.functional.cross_entropy(m(x), batch["y"])
    loss.backward()
    for h in hooks:
        h.remove()
    return seen, {n: p.grad.detach().double().numpy() for n, p in m.named_parameters()}


def _worst(grads: dict[str, Any], ref: dict[str, Any]) -> tuple[float, str]:
    return max((float(np.linalg.norm(grads[n] - ref[n]) / np.linalg.norm(ref[n])), n) for n in ref)


def _flips(a: list[Any], b: list[Any]) -> list[tuple[int, int, float, float]]:
    """(call, flat index, a's value, b's value) where the two decide a ReLU otherwise."""
    out = []
    for k, (x, y) in enumerate(zip(a, b)):
        for i in np.nonzero(((x > 0) != (y > 0)).reshape(-1).numpy())[0]:
            out.append((k, int(i), float(x.reshape(-1)[i]), float(y.reshape(-1)[i])))
    return out


def torch_stage(work: Path, seeds: int, frontend: str) -> list[str]:
    import torch

    sys.path.insert(0, str(HERE))
    from export_check import _recipe
    from safetensors.torch import save_file

    if frontend == "torch_xla":
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        from stepbundle.exporter import export
    else:
        from stepbundle.export_torch import export

    work.mkdir(parents=True, exist_ok=True)
    recipe = _recipe("resnet18")
    model, batch = _model_and_batch(0)
    assert all(torch.equal(batch[k], recipe.example_batch[k]) for k in batch)
    theirs = recipe.model.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())
    save_file({k: v.contiguous() for k, v in batch.items()}, str(work / "resnet18.batch"))
    # Exported first: torch_xla's exporter fails in a process whose autograd engine ran a
    # CPU backward before torch_xla started ("device_ready_queues_" assertion).
    rep = export(recipe, str(work / "resnet18.stepbundle"), check=False)
    up64: list[Any] = []
    pre64, g64 = _step(model, batch, torch.float64, upstream=up64)
    pre32, g32 = _step(model, batch, torch.float32)
    # The ties: float64's ReLU inputs of smallest magnitude, over every call.
    flat = [(float(abs(x.reshape(-1)[i])), k, int(i))
            for k, x in enumerate(pre64) for i in torch.topk(x.abs().reshape(-1), TIES, largest=False).indices]  # fmt: skip
    ties = sorted(flat)[:TIES]
    # How far float32 is from float64 at each call's input, normwise and at most.
    err32 = [(float((b - a).norm() / a.norm()), float((b - a).abs().max())) for a, b in zip(pre64, pre32)]  # fmt: skip
    ref: dict[str, Any] = {f"grad64:{n}": v for n, v in g64.items()}
    ref.update({f"grad32:{n}": v for n, v in g32.items()})
    for k, x in enumerate(pre64):
        ref[f"pre64:{k}"] = x.numpy()
        ref[f"pre32:{k}"] = pre32[k].numpy()
    lines = [
        "PyTorch float32 against float64 at each ReLU call's input (normwise, largest "
        "absolute), and float64's smallest ReLU inputs (the ties) with what float64 "
        "gives when that one ReLU decides the other way (`flipped`: its worst gradient "
        "against float64's):",
        "",
        "| tie | ReLU call | shape | index (N, C, H, W) | float64 | float32 | float32's error at that call (normwise, largest) | float64's gradient at the ReLU's output there | flipped: worst gradient |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t, (_, k, i) in enumerate(ties):
        _, gf = _step(model, batch, torch.float64, flip=(k, i))
        for n, v in gf.items():
            ref[f"tie{t}:{n}"] = v
        ref[f"tie{t}:where"] = np.array([k, i])
        shape = tuple(pre64[k].shape)
        idx = tuple(int(j) for j in np.unravel_index(i, shape))
        w, name = _worst(gf, g64)
        lines.append(
            f"| {t} | {k} | {list(shape)} | {list(idx)} | {float(pre64[k].reshape(-1)[i]):.4g} "
            f"| {float(pre32[k].reshape(-1)[i]):.4g} | {err32[k][0]:.2e}, {err32[k][1]:.2e} "
            f"| {float(up64[k].reshape(-1)[i]):.5g} "
            f"| {w:.2e} (`{name}`) |"
        )
    np.savez(work / "resnet18.ref.npz", **ref)
    flips = _flips(pre64, pre32)
    w, name = _worst(g32, g64)
    lines += ["", f"PyTorch float32 itself: worst gradient {w:.2e} from float64 (`{name}`); "
              f"ReLU decisions other than float64's: {flips or 'none'}.", ""]  # fmt: skip
    lines += [f"Bundle ({frontend} front-end): {rep.path}, {rep.digest}.", ""]
    lines += [
        f"Seeds 0-{seeds - 1} (the same recipe drawn from each seed): PyTorch float32 "
        "(contiguous, and channels_last) against float64, the ReLU decisions it takes "
        "otherwise (call, index, float64's input, float32's) and its worst gradient:",
        "",
        "| seed | float64's smallest ReLU input | float32: flips | worst gradient | channels_last: flips | worst gradient |",
        "|---|---|---|---|---|---|",
    ]
    for seed in range(seeds):
        m, b = _model_and_batch(seed)
        p64, h64 = _step(m, b, torch.float64)
        row = [str(seed), f"{min(float(x.abs().min()) for x in p64):.2g}"]
        for cl in (False, True):
            p32, h32 = _step(m, b, torch.float32, channels_last=cl)
            f = _flips(p64, p32)
            w, name = _worst(h32, h64)
            row += ["; ".join(f"{k}, {i}, {a:.2g}, {c:.2g}" for k, i, a, c in f) or "none",
                    f"{w:.2e} (`{name}`)"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    return lines


# ---------------------------------------------------------------- runtime


def _relu_inputs(hlo: str) -> list[str]:
    """The names of every ``maximum(x, broadcast(0))``'s ``x`` in the ENTRY of ``hlo``,
    in program order."""
    body = hlo[hlo.index("\nENTRY") :]
    defs = {m.group(1): m.group(2) for m in re.finditer(r"%(\S+) = \S+ (.*)", body)}

    def zero(name: str) -> bool:
        d = defs.get(name, "")
        m = re.match(r"broadcast\(%(\S+)\)", d)
        if m:
            d = defs.get(m.group(1), "")
        return bool(re.match(r"constant\((0|-?0\.0*)\)", d))

    out = []
    for m in re.finditer(r"%\S+ = f32\[[^\]]*\]\S* maximum\(%([^,]+), %([^)]+)\)", body):
        a, b = m.group(1), m.group(2)
        if zero(b):
            out.append(a)
        elif zero(a):
            out.append(b)
    return out


def _append_results(hlo: str, names: list[str]) -> str:
    """``hlo`` with ``names`` (ENTRY instructions) appended to its result tuple."""
    lines = hlo.split("\n")
    head = lines[0]
    i = head.find(", entry_computation_layout={")
    if i >= 0:  # the result layout changes: let the parser infer it
        j, depth = i + len(", entry_computation_layout={"), 1
        while depth:
            depth += {"{": 1, "}": -1}.get(head[j], 0)
            j += 1
        lines[0] = head[:i] + head[j:]
    shapes = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ", line)
        if m:
            shapes[m.group(1)] = m.group(2)
    entry = next(k for k, line in enumerate(lines) if line.startswith("ENTRY"))
    root = next(k for k in range(entry, len(lines)) if lines[k].lstrip().startswith("ROOT"))
    m = re.match(r"(\s*ROOT %\S+ = \()(.*)(\) tuple\()(.*)(\).*)$", lines[root])
    if m is None:
        raise SystemExit("the ENTRY's result is not a tuple")
    lines[root] = (m.group(1) + m.group(2) + "".join(", " + shapes[n] for n in names)
                   + m.group(3) + m.group(4) + "".join(", %" + n for n in names) + m.group(5))  # fmt: skip
    lines[entry] = (lines[entry][:-3]
                    + "".join(", " + re.sub(r"\{[0-9,]*\}", "", shapes[n]) for n in names) + ") {")  # fmt: skip
    return "\n".join(lines)


def runtime_child(work: Path, out: Path) -> None:
    """One step of the bundle through the runtime, under this process's XLA_FLAGS (with a
    dump of the program before its barriers are removed); writes ``out`` (npz)."""
    import jax

    from stepbundle.runtime import CompileOptions, LoadOptions, _compat, load
    from stepbundle.runtime.io.tensor_file import open_safetensors

    extra = tuple(
        tuple(w.split("=", 1)) for w in os.environ.get("RELU_TIES_OVERRIDES", "").split() if w
    )
    if extra:  # per-compile options besides the runtime's own (env_option_overrides)
        own = _compat.cpu_numerics_overrides

        def overrides(flags: str) -> tuple[tuple[tuple[str, str], ...], str]:
            got, words = own(flags)
            return got + extra, f"{words}; per compile also {extra}"  # type: ignore[operator]

        _compat.cpu_numerics_overrides = overrides  # type: ignore[assignment]
    captured: list[list[Any]] = []
    call = _compat.ExecutableCall.__call__

    def capture(self: Any, args: list[Any]) -> list[Any]:
        if not captured:
            captured.append([np.asarray(a) for a in args])
        results = call(self, args)
        if len(captured) == 1:
            captured.append([np.asarray(r) for r in results])
        return results

    _compat.ExecutableCall.__call__ = capture  # type: ignore[method-assign]
    trainer = load(work / "resnet18.stepbundle",
                   options=LoadOptions(compile=CompileOptions(cache_dir=False, entries="train")))  # fmt: skip
    with open_safetensors(work / "resnet18.batch") as f:
        batch = {n: np.array(f.array(n)) for n in f.records}
    trainer.step(batch)
    trainer.block_until_ready()
    state = trainer.state_dict()
    saved: dict[str, Any] = {
        k.removeprefix("optimizer.state.").removesuffix(".momentum_buffer"): np.asarray(v)
        for k, v in state.items()
        if k.endswith(".momentum_buffer")
    }
    info = {"numerics": trainer.load_info.cpu_numerics, "jax": jax.__version__,
            "relu": "not read (no dump of the program before cse_barrier_expander)"}  # fmt: skip
    dumps = sorted(Path(os.environ["RELU_TIES_DUMP"]).glob("*before_cse_barrier_expander*.txt"),
                   key=lambda p: p.stat().st_size)  # fmt: skip
    if dumps:
        try:
            info["relu"] = _read_relu_inputs(dumps[-1].read_text(), captured, saved)
        # jaxlib's HLO text and MLIR bindings are internal: another version may lack them.
        except Exception as e:  # noqa: BLE001
            info["relu"] = f"not read ({type(e).__name__}: {str(e)[:200]})"
    saved["info"] = np.array(json.dumps(info))
    np.savez(out, **saved)


def _read_relu_inputs(hlo: str, captured: list[list[Any]], saved: dict[str, Any]) -> str:
    """Compile ``hlo`` (the train program) with every ReLU input appended to its results,
    run it on the step's arguments, and add the inputs to ``saved`` ("relu:K")."""
    import jax
    from jax._src.lib import _jax, xla_client

    from stepbundle.runtime import _compat
    from stepbundle.runtime.compile.cpu_numerics import cpu_numerics

    names = _relu_inputs(hlo)
    text = _append_results(hlo, names)
    module = xla_client.hlo.hlo_module_from_text(text)
    bytecode = _jax.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())
    client = _compat.get_client("cpu")
    dev = client.local_devices()[0]
    options = _compat.compile_options(1, [dev.id], cpu_numerics().overrides)
    exe = _compat.compile_bytecode(client, bytecode, [dev], options)
    with _compat.x64_scope():
        args = [jax.device_put(a, dev) for a in captured[0]]
    results = [np.asarray(r) for r in exe.execute(args)]
    n = len(captured[1])
    # The appended results change XLA's fusions, so the rounding may move: how far the
    # program's own results are from the runtime step's (floating ones, normwise).
    moved = max(
        (float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))
         for a, b in zip(results[:n], captured[1]) if b.dtype.kind == "f" and b.size),
        default=0.0,
    )  # fmt: skip
    for k, r in enumerate(results[n:]):
        saved[f"relu:{k}"] = r
    return (f"{len(names)} ReLU inputs read; the program's own results with them appended "
            f"are within {moved:.1e} (normwise) of the runtime step's")  # fmt: skip


def _nchw(x: np.ndarray, like: np.ndarray) -> np.ndarray | None:
    """``x`` as ``like``'s NCHW shape: as it is, or from NHWC."""
    if x.shape == like.shape:
        return x.astype(np.float64)
    if x.ndim == 4 and x.transpose(0, 3, 1, 2).shape == like.shape:
        return x.transpose(0, 3, 1, 2).astype(np.float64)
    return None


def runtime_stage(work: Path, flags: list[str]) -> list[str]:
    import jax

    ref = dict(np.load(work / "resnet18.ref.npz"))
    g64 = {k.removeprefix("grad64:"): v for k, v in ref.items() if k.startswith("grad64:")}
    pre64 = [ref[f"pre64:{k}"] for k in range(sum(k.startswith("pre64:") for k in ref))]
    pre32 = [ref[f"pre32:{k}"] for k in range(len(pre64))]
    ties = sorted({k.split(":")[0] for k in ref if k.startswith("tie") and k.endswith(":where")})
    lines = [
        "| XLA_FLAGS (and environment) | worst gradient vs float64 | nearest float64 step (tie flipped): worst gradient | "
        "ReLU decisions other than float64's (call, index, float64, runtime) | the runtime's inputs at the ties | ReLU inputs vs float64, normwise: runtime / PyTorch float32 (worst call) |",
        "|---|---|---|---|---|---|",
    ]
    notes = []
    for flag in flags:
        with tempfile.TemporaryDirectory(prefix="relu-ties-") as tmp:
            dump = Path(tmp) / "dump"
            # NAME=VALUE words are environment variables (STEPBUNDLE_CPU_BLOCKED_SUMS=0),
            # per-compile:NAME=VALUE an XLA option set per compile (as the runtime sets
            # its own), the rest XLA flags.
            words = flag.split()
            xla = " ".join(w for w in words if w.startswith("--"))
            per = " ".join(
                w.removeprefix("per-compile:") for w in words if w.startswith("per-compile:")
            )
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "RELU_TIES_DUMP": str(dump),
                   "RELU_TIES_OVERRIDES": per,
                   **dict(w.split("=", 1) for w in words if not w.startswith(("--", "per-compile:"))),
                   "XLA_FLAGS": f"{xla} --xla_dump_to={dump} --xla_dump_hlo_as_text "
                                "--xla_dump_hlo_pass_re=cse_barrier_expander".strip()}  # fmt: skip
            out = Path(tmp) / "out.npz"
            proc = subprocess.run([sys.executable, __file__, "runtime-child", str(work), str(out)],
                                  env=env, capture_output=True, text=True)  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(
                    f"the runtime's step under {flag!r} failed:\n{proc.stderr[-3000:]}"
                )
            got = dict(np.load(out))
        info = json.loads(str(got.pop("info")))
        grads = {n: got[n].astype(np.float64) for n in g64}
        w, name = _worst(grads, g64)
        nearest = min(
            (_worst(grads, {n: ref[f"{t}:{n}"] for n in g64}) + (t, tuple(ref[f"{t}:where"])))
            for t in ties
        )
        relu = [
            got[k]
            for k in sorted((k for k in got if k.startswith("relu:")), key=lambda s: int(s[5:]))
        ]
        decided, ratio, at_ties = "not read", "", "not read"
        if relu:
            mine = []
            for x64 in pre64:  # the XLA input of the same shape nearest to it
                cands = [y for y in (_nchw(r, x64) for r in relu) if y is not None]
                mine.append(min(cands, key=lambda y: float(np.linalg.norm(y - x64))))
            flips = [(k, int(i), float(pre64[k].reshape(-1)[i]), float(mine[k].reshape(-1)[i]))
                     for k in range(len(pre64))
                     for i in np.nonzero(((pre64[k] > 0) != (mine[k] > 0)).reshape(-1))[0]]  # fmt: skip
            decided = "; ".join(f"{k}, {i}, {a:.3g}, {b:.3g}" for k, i, a, b in flips) or "none"
            where = [tuple(int(v) for v in ref[f"{t}:where"]) for t in ties]
            at_ties = ", ".join(
                f"{t} {float(mine[k].reshape(-1)[i]):.3g}" for t, (k, i) in zip(ties, where)
            )
            rel = [(float(np.linalg.norm(m - a) / np.linalg.norm(a)),
                    float(np.linalg.norm(p - a) / np.linalg.norm(a)), k)
                   for k, (m, p, a) in enumerate(zip(mine, pre32, pre64))]  # fmt: skip
            worst_call = max(rel, key=lambda r: r[0] / r[1])
            ratio = (f"{worst_call[0]:.2e} / {worst_call[1]:.2e} = {worst_call[0] / worst_call[1]:.2f} (call {worst_call[2]}); "
                     f"median ratio {float(np.median([r[0] / r[1] for r in rel])):.2f}")  # fmt: skip
        lines.append(
            f"| `{flag or '(none)'}` | {w:.2e} (`{name}`) | {nearest[0]:.2e} ({nearest[2]}: call "
            f"{nearest[3][0]}, index {nearest[3][1]}) | {decided} | {at_ties} | {ratio or 'not read'} |"
        )
        notes.append(f"`{flag or '(none)'}`: {info['numerics']}; {info['relu']}.")
        print(lines[-1], flush=True)
    return [*lines, "", *notes, "", f"jax {jax.__version__}."]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("stage", choices=["torch", "runtime", "runtime-child"])
    p.add_argument("work", type=Path)
    p.add_argument("child_out", nargs="?", type=Path)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--frontend", choices=["torch", "torch_xla"], default="torch")
    p.add_argument("--flags", action="append", help="one configuration: XLA flags and "
                   "NAME=VALUE environment words, as --flags='--xla_...' (repeat; default: "
                   "DEFAULT_FLAGS)")  # fmt: skip
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    if a.stage == "runtime-child":
        runtime_child(a.work, a.child_out)
        return
    command = "benchmarks/relu_ties.py " + " ".join(sys.argv[1:])
    if a.stage == "torch":
        import torch

        lines = torch_stage(a.work, a.seeds, a.frontend)
        version = f"torch {torch.__version__}"
    else:
        import jax

        lines = runtime_stage(a.work, a.flags or list(DEFAULT_FLAGS))
        version = f"jax {jax.__version__}"
    text = _heading(command, version) + "\n" + "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        with open(a.out, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
