"""What the export check costs beside the export itself, on resnet18 and GPT-2 small,
through both front-ends (issue #39 item 2).

Each export runs in a fresh process (``--child``), with the check on, timed from after
the imports: the export's own stages (trace, lower, write) and the check's wall time,
its runtime process (start, load and compile, one step, write), its eager step(s), and
the processor time of each part (this process and its children: on a shared machine a
fairer measure than wall time). Writes one results file, benchmarks/results/export_check.md:
a run replaces the rows of its models and front-ends and keeps the others (each
environment has one front-end; earlier figures live in git). Usage:

    .venv/bin/python benchmarks/export_check.py                # torch_xla
    .venv-torch/bin/python benchmarks/export_check.py          # torch

The children run with bytecode caches, as an installed package has them (pip compiles
at install): this machine's sessions set ``PYTHONDONTWRITEBYTECODE=1``, under which every
fresh process compiles jax's sources again (about 1.2 s of processor time for the
check's runtime process, 2.3 s with it); here ``PYTHONPYCACHEPREFIX`` points at the work
folder and a first process fills it before any row.

Each environment runs the front-ends it has: ``.venv`` the torch_xla front-end
(``stepbundle.exporter``), ``.venv-torch`` the torch front-end
(``stepbundle.export_torch``). ``--models resnet18 gpt2`` picks models.

Models: torchvision resnet18 (10 classes, batch 8 of 64x64 images, SGD momentum 0.9);
Hugging Face ``GPT2LMHeadModel`` from its default config (124M parameters; dropout 0,
eager attention), AdamW, batch 2 x 128 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "export_check.md"
MODELS = ("resnet18", "gpt2")


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _recipe(name: str) -> Any:
    import torch

    from stepbundle.frontend.recipe import Recipe

    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision

        model = torchvision.models.resnet18(num_classes=10)
        batch = {"x": torch.randn(8, 3, 64, 64), "y": torch.randint(0, 10, (8,))}
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(model, optimizer, batch):  # type: ignore[no-untyped-def]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
            loss.backward()
            optimizer.step()
            return {"loss": loss}

    elif name == "gpt2":
        import transformers

        cfg = transformers.GPT2Config(
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"
        )
        model = transformers.GPT2LMHeadModel(cfg)
        model.train()
        ids = torch.randint(0, cfg.vocab_size, (2, 129))
        batch = {"x": ids[:, :-1].contiguous(), "y": ids[:, 1:].contiguous()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model, optimizer, batch):  # type: ignore[no-untyped-def]
            optimizer.zero_grad()
            logits = model(input_ids=batch["x"]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch["y"].reshape(-1)
            )
            loss.backward()
            optimizer.step()
            return {"loss": loss}

    else:
        raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return Recipe(model=model, optimizer=opt, step=step, example_batch=batch)


def child(name: str, frontend: str, out: str) -> None:
    if frontend == "torch_xla":
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        from stepbundle.exporter import export
    else:
        from stepbundle.export_torch import export
    from safetensors.torch import save_file

    recipe = _recipe(name)
    save_file({k: v.contiguous() for k, v in recipe.example_batch.items()}, out + ".batch")
    cpu0, t0 = _cpu(), time.perf_counter()
    rep = export(recipe, out, check=True)
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    chk = rep.check
    assert chk is not None and chk.ran, chk
    stages = {k: v for k, v in rep.stage_seconds.items() if k != "check"}
    print(
        json.dumps(
            {
                "stages_s": stages,
                "export_s": sum(stages.values()),
                "export_cpu_s": cpu - chk.cpu_seconds,
                "check_s": chk.seconds,
                "check_cpu_s": chk.cpu_seconds,
                "runtime_s": chk.runtime_seconds,
                "runtime_cpu_s": chk.runtime_cpu_seconds,
                "runtime_parts_s": dict(chk.runtime_parts),
                "eager_s": chk.eager_seconds,
                "eager_cpu_s": chk.eager_cpu_seconds,
                "closest": chk.closest,
                "ties_cpu_s": getattr(chk, "ties_cpu_seconds", 0.0),
                "ties": getattr(chk, "ties", ""),
                "line": chk.line(),
                "total_s": wall,
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            }
        )
    )


def run_child(bundle: str) -> None:
    """What a later ``stepbundle run`` of the bundle on this machine pays up to its first
    step: ``load`` with run's CPU defaults (every entry, the compile cache of
    ``STEPBUNDLE_CACHE_DIR``, one step per call) and one step."""
    import numpy as np

    from stepbundle.runtime import load
    from stepbundle.runtime.io.tensor_file import open_safetensors

    cpu0, t0 = _cpu(), time.perf_counter()
    trainer = load(bundle, "cpu")
    compile_s = trainer.load_info.seconds["compile"]
    with open_safetensors(bundle + ".batch") as f:
        batch = {n: np.array(f.array(n)) for n in f.records}
    trainer.step(batch)
    trainer.block_until_ready()
    hits = trainer.load_info.cache_hits
    print(json.dumps({"s": time.perf_counter() - t0, "cpu_s": _cpu() - cpu0,
                      "compile_s": compile_s, "hits": hits}))  # fmt: skip


def _run_after(bundle: str, cache: str, env: dict[str, str]) -> dict[str, Any]:
    """``run_child`` in a fresh process, with ``cache`` as its compile cache."""
    env = {**env, "STEPBUNDLE_CACHE_DIR": cache, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, __file__, "--run-child", bundle],
                          capture_output=True, text=True, env=env)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"the run after the export failed:\n{proc.stderr[-4000:]}")
    got: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return got


def _frontends() -> list[str]:
    import importlib.util

    return ["torch_xla"] if importlib.util.find_spec("torch_xla") else ["torch"]


def _commit() -> str:
    """The checkout's commit, with '+dirty' where the files measured differ from it."""
    root = HERE.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    measured = ["frontend_core", "cli/step_check.py", "benchmarks/export_check.py"]
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *measured], cwd=root,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return head + ("+dirty" if dirty else "")


def _parts(got: dict[str, Any]) -> str:
    """The runtime process's wall seconds by part from the bundle handed to it: start
    (what of the process's start and imports the export did not hide), compile, state
    (read, verified, placed), step, write."""
    p = got["runtime_parts_s"]
    start = got["runtime_s"] - p["load"] - p["step"] - p["write"]
    return " / ".join(
        f"{v:.1f}"
        for v in (start, p["load.compile"], p["load.state"] + p["load.open"], p["step"], p["write"])
    )


def _cpu_parts(got: dict[str, Any]) -> str:
    """The runtime process's processor seconds by part: start (interpreter and imports),
    load (compile and state), step, write."""
    p = got["runtime_parts_s"]
    return " / ".join(f"{p[k]:.1f}" for k in ("cpu.start", "cpu.load", "cpu.step", "cpu.write"))


def _key(row: str) -> tuple[str, ...]:
    """A row's model, front-end and XLA_FLAGS (a run with flags and one without sit side
    by side)."""
    cells = [c.strip() for c in row.split("|")]
    return (cells[1], cells[2], cells[20] if len(cells) > 20 else "")


def _ties(got: dict[str, Any]) -> str:
    """The tie arbitration's processor time and what it found (0: no tensor failed, it
    never ran)."""
    found = re.search(r"element (\[[^\]]*\])", got["ties"]) if got["ties"] else None
    said = f" ({found.group(1)} flipped)" if found else ""
    return f"{got['ties_cpu_s']:.1f} s{said}"


def _rows_kept() -> list[str]:
    """The rows already in the results file (a row for the same model and front-end is
    replaced by the new one)."""
    if not RESULTS.exists():
        return []
    return [
        line
        for line in RESULTS.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| model")
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--run-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.run_child:
        run_child(args.run_child)
        return
    work = Path("/tmp/stepbundle-export-check")
    work.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    frontends = _frontends()
    # The bytecode of what the rows' processes import, compiled once before any row.
    imports = ["jax", "stepbundle.cli.step_check", "stepbundle.runtime", "torchvision",
               "transformers.models.gpt2.modeling_gpt2", "safetensors.torch"]  # fmt: skip
    if "torch_xla" in frontends:
        imports += ["torch_xla", "stepbundle.exporter"]
    else:
        imports += ["torch._dynamo", "torch.export", "stepbundle.export_torch"]
    subprocess.run([sys.executable, "-c", "; ".join(f"import {m}" for m in imports)],
                   check=True, env={**env, "JAX_PLATFORMS": "cpu", "PJRT_DEVICE": "CPU"})  # fmt: skip
    rows: list[str] = []
    for frontend in frontends:
        for name in args.models:
            out = str(work / f"{name}-{frontend}.stepbundle")
            # A compile cache of the row's own: the check fills it, a run after it reads it.
            cache = work / f"{name}-{frontend}.cache"
            subprocess.run(["rm", "-rf", str(cache), str(cache) + "-cold"], check=True)
            load = os.getloadavg()[0]
            flags = f"`{os.environ['XLA_FLAGS']}`" if os.environ.get("XLA_FLAGS") else ""
            proc = subprocess.run(
                [sys.executable, __file__, "--child", name, frontend, out],
                capture_output=True,
                text=True,
                env={**env, "STEPBUNDLE_CACHE_DIR": str(cache)},
            )
            if proc.returncode != 0:  # e.g. killed for memory (-9): said in the row
                print(f"{name} on {frontend} failed:\n{proc.stderr[-4000:]}", flush=True)
                rows.append(
                    f"| {name} | {frontend} | failed: exit code {proc.returncode} "
                    f"| | | | | | | | | | | | | | | {_commit()} | {load:.1f} | {flags} | |"
                )
            else:
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                print(name, frontend, json.dumps(got), flush=True)
                warm = _run_after(out, str(cache), env)  # the cache as the check left it
                cold = _run_after(out, str(cache) + "-cold", env)  # empty: no check before
                print("run after", json.dumps(warm), "without", json.dumps(cold), flush=True)
                ratio = got["check_cpu_s"] / got["export_cpu_s"]
                net = got["check_cpu_s"] + warm["cpu_s"] - cold["cpu_s"]
                net_wall = got["check_s"] + warm["s"] - cold["s"]
                closest = re.sub(r"\s+", " ", got["closest"]).replace("|", "/")
                rows.append(
                    f"| {name} | {frontend} | {got['export_s']:.1f} s "
                    f"| {got['export_cpu_s']:.1f} s | {got['check_s']:.1f} s "
                    f"| {got['runtime_s']:.1f} s | {got['eager_s']:.1f} s "
                    f"| {got['check_cpu_s']:.1f} s | {ratio:.2f} "
                    f"| {got['runtime_cpu_s']:.1f} s | {got['eager_cpu_s']:.1f} s "
                    f"| {_parts(got)} | {_cpu_parts(got)} | {closest} "
                    f"| {warm['cpu_s']:.1f} s ({warm['hits']} hit) / {cold['cpu_s']:.1f} s "
                    f"| {net:.1f} s ({net / got['export_cpu_s']:.2f}) "
                    f"| {net_wall:.1f} s | {_commit()} | {load:.1f} | {flags} | {_ties(got)} |"
                )
            _write(rows)


def _write(rows: list[str]) -> None:
    new = {_key(r) for r in rows}
    kept = [r for r in _rows_kept() if _key(r) not in new]
    # Rows from before the tie arbitration have no column for it.
    kept = [r + " (code before it) |" if r.count("|") == 21 else r for r in kept]
    lines = [
        "# The export check's cost beside the export",
        "",
        "`benchmarks/export_check.py` (`.venv`: the torch_xla front-end; `.venv-torch`: the torch",
        "front-end). resnet18: torchvision, 10 classes, batch 8 of 64x64, SGD momentum 0.9.",
        "gpt2: Hugging Face GPT2LMHeadModel, default config (124M parameters), dropout 0, eager",
        "attention, AdamW, batch 2 x 128. Each export in a fresh process; wall seconds on a",
        "shared 2-core machine (inflated by other jobs), processor seconds of the exporting",
        "process and its children. 'check/export': the check's processor time over the",
        "export's. 'runtime, cpu': the runtime's process (python -m stepbundle.cli.step_check);",
        "'eager, cpu': the eager step(s) in the exporting process (float32, and float64 where",
        "a tensor needed the arbiter). 'runtime parts': its wall seconds from the bundle handed",
        "to it, for start (what of the process's start and imports the export did not hide:",
        "the front-ends start it before they trace) / compile / state (read, SHA-256, placed) /",
        "step / write; 'runtime parts, cpu': its processor seconds for start / load (compile",
        "and state) / step / write. Python's bytecode is cached for the rows' processes, as",
        "in an installed package (this machine's sessions set PYTHONDONTWRITEBYTECODE=1).",
        "'load': the machine's 1-minute load average when the row's export began (2 cores);",
        "'XLA_FLAGS': the environment's, where the run set any (the runtime's process adds",
        "its own on jaxlib 0.7.1: cli/step_check.py). Since 2026-12-07 10:15 UTC the machine",
        "is a Zen 4 host with AVX-512, on which the runtime's step decides one ReLU input of",
        "resnet18 the other way from PyTorch (relu_ties.md): the rows with XLA_FLAGS cap the ISA",
        "XLA compiles for, under which it does not, as the check needed before its tie",
        "arbitration; the rows without are the host's own. 'ReLU ties, cpu': the tie",
        "arbitration's processor time (in 'eager, cpu' and 'check, cpu' too; 0.0 where no",
        "tensor failed, so it never ran) and the element float64 decided the bundle's way.",
        "The export's processor time moves with it (GPT-2's torch export took 44.3 s of",
        "processor time at load 1-8 and 55.1 s at load 7.4 on 2026-12-07), so the ratios are",
        "rough. Without a cache entry (the torch_xla rows, jaxlib 0.7.1) the two later runs",
        "differ by noise alone, and the net figure is the gross one plus it.",
        "The runtime's process compiles the train program as `stepbundle run` does and leaves",
        "it in the compile cache (on jaxlib 0.10 and later; on 0.7.1, the torch_xla rows, it",
        "compiles fast and leaves no entry). 'run after, cpu': a later run's load (run's CPU defaults) and",
        "first step, in a fresh process, with the cache the check filled (its hits) / with an",
        "empty cache, as after an export without the check. 'net check, cpu': the check's",
        "processor time plus the first of those minus the second: what the check adds from the",
        "export's start to a run's first step on this machine (over the export's own, in",
        "brackets); 'net check, wall': the same in wall seconds.",
        "",
        "| model | front-end | export, wall | export, cpu | check, wall "
        "| runtime process, wall | eager, wall | check, cpu | check/export (cpu) "
        "| runtime, cpu | eager, cpu | runtime parts, wall | runtime parts, cpu "
        "| closest to its bound "
        "| run after, cpu: warm / cold | net check, cpu | net check, wall | commit | load "
        "| XLA_FLAGS | ReLU ties, cpu |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *sorted(kept + rows),
    ]
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
