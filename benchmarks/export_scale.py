"""Export at scale (issue #40): wall time, CPU time and peak RSS of a weights-free export,
per model and front-end, each in a child process of its own.

Models: ``gpt55m`` (the 55M GPT of ``device/gpt.py``: bf16 autocast, AdamW, context 512,
batch 16), and the Llama-style models of ``llama.py``: ``llama117m`` (context 1024, batch 8),
``llama1b`` (TinyLlama 1.1B's shapes, context 2048, batch 4) and ``llama8b`` (Llama 3 8B's
shapes, context 2048, batch 1); ``tiny`` for the test. Every step starts with
``optimizer.zero_grad()``, but ``gpt55m_zero_grad_last``'s: the same GPT whose step clears
the gradients at its end instead (``optimizer.zero_grad(set_to_none=True)`` after
``optimizer.step()``, nanoGPT's ``train.py``), the form that cost the torch_xla front-end
5x the time and 3.5x the memory before 5d7b929.

The torch front-end (``.venv-torch``) builds the Llama models on the meta device (no
weights in memory; ``llama.recipe``) and the GPT on the CPU; the torch_xla front-end
(``.venv``) needs a real model on its device, so it builds every model on the CPU.

Where the memory goes: the child hears the export's stages (its ``ticker``) and reads its
own peak and current resident set (``VmHWM``, ``VmRSS`` of ``/proc/self/status``) when
each stage ends, after building the recipe and after the export; ``rss_after_stage_gb``
lists them in order, with what each stage added to the peak (``added_gb``). The lowering
of the last program and the writing of the bundle share the last reading (the torch_xla
front-end lowers inside the writer).

Each child runs under an address-space limit (``--max-gb``, default 12: the machine is
shared); the parent reads the child's peak RSS and CPU time from ``os.wait4`` (that child's
own ``rusage``: what ``resource.getrusage(RUSAGE_CHILDREN)`` sums over children) and times
it from start to exit (imports and building the recipe included; ``export_s`` is the export
call alone). A row the front-end cannot run within the
limit says so, with the reason, instead of a figure; ``--skip`` names rows not to try
(``torch_xla:llama1b``), whose reason is then the projection from the measured bytes per
parameter. Each row records the commit it was measured at, whether the tree had changes
beside it, and the load average when it ended. ``--merge`` makes one results file of
several runs' (the rows of a later file replace the same rows of an earlier one;
``--source-git FILE=COMMIT:clean`` records what its runner knew of the tree, where the
file's own record was taken later; ``--earlier LABEL=FILE`` keeps another run's rows for a
comparison, out of the table). Usage::

    .venv/bin/python benchmarks/export_scale.py                       # every row
    .venv/bin/python benchmarks/export_scale.py --models tiny --frontends torch --out /tmp/x.json
    .venv/bin/python benchmarks/export_scale.py --merge /tmp/torch.json /tmp/xla.json

Writes ``benchmarks/results/export_scale.json`` (every figure) and prints the markdown table
(``docs/exporting.md`` carries it).

Imports: the standard library; the children import torch and a front-end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = ("gpt55m", "gpt55m_zero_grad_last", "llama117m", "llama1b", "llama8b")
FRONTENDS = ("torch", "torch_xla")
PYTHON = {"torch": ROOT / ".venv-torch/bin/python", "torch_xla": ROOT / ".venv/bin/python"}
GB = 1e9


# ---------------------------------------------------------------------------- child
def _recipe(model: str, frontend: str) -> tuple[Any, str, int]:
    """The recipe, the device its model was built on, and its parameter count."""
    sys.path[:0] = [str(HERE), str(HERE / "device")]
    if model in ("gpt55m", "gpt55m_zero_grad_last"):
        import gpt

        r = gpt.recipe()
        if model == "gpt55m_zero_grad_last":
            r.step = _zero_grad_last(gpt)
        device = "cpu"
    else:
        import llama

        device = "meta" if frontend == "torch" else "cpu"
        r = llama.recipe(model, device=device)
    return r, device, sum(p.numel() for p in r.model.parameters())


def _zero_grad_last(gpt: Any) -> Any:
    """``gpt.recipe``'s step with the gradients cleared at its end, as nanoGPT's
    ``train.py`` does: ``optimizer.zero_grad(set_to_none=True)`` after ``optimizer.step()``."""
    import torch

    def step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
        with torch.autocast(device_type=batch["idx"].device.type, dtype=torch.bfloat16):
            logits = model(batch["idx"])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, gpt.VOCAB), batch["target"].reshape(-1)
        )
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), gpt.CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": loss, "grad_norm": grad_norm}

    return step


def _memory_gb() -> tuple[float, float]:
    """This process's peak and current resident set (``VmHWM``, ``VmRSS``), in GB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    peak, rss = (int(fields[k].split()[0]) * 1024 / GB for k in ("VmHWM", "VmRSS"))
    return peak, rss


class StageMemory:
    """A ticker that reads the resident set when a stage ends (the next one starts)."""

    def __init__(self) -> None:
        self.readings: list[dict[str, Any]] = []
        self._stage: str | None = None
        self._lock = threading.Lock()

    def end(self, stage: str) -> None:
        peak, rss = _memory_gb()
        before = self.readings[-1]["peak_gb"] if self.readings else 0.0
        self.readings.append(
            {"after": stage, "peak_gb": peak, "added_gb": peak - before, "rss_gb": rss}
        )

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        with self._lock:
            if stage != self._stage:
                if self._stage is not None:
                    self.end(self._stage)
                self._stage = stage

    def finish(self) -> None:
        with self._lock:
            if self._stage is not None:
                self.end(f"{self._stage}, then writing the bundle")


def child(model: str, frontend: str, out: str) -> None:
    t0 = time.perf_counter()
    if frontend == "torch_xla":
        from stepbundle.exporter import export
        from stepbundle.exporter.workspace import xla_device

        xla_device()  # before any CPU autograd
    else:
        from stepbundle.export_torch import export
    r, device, params = _recipe(model, frontend)
    t1 = time.perf_counter()
    memory = StageMemory()
    memory.end("imports and building the recipe")
    report = export(
        r, out, check=False, progress=lambda m: print(m, file=sys.stderr), ticker=memory
    )
    t2 = time.perf_counter()
    memory.finish()
    line = {
        "imports_and_build_s": t1 - t0,
        "export_s": t2 - t1,
        "stages_s": report.stage_seconds,
        "bundle_bytes": report.size,
        "parameters": params,
        "built_on": device,
        "rss_after_stage_gb": memory.readings,
    }
    print(json.dumps(line))


# --------------------------------------------------------------------------- parent
def _limit(max_bytes: int) -> Any:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))

    return apply


def run_row(model: str, frontend: str, work: Path, max_gb: float, timeout: float) -> dict[str, Any]:
    out = work / f"{model}-{frontend}.stepbundle"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "STEPBUNDLE_EXPORT_CHECK": "0"}
    logs = work / f"{model}-{frontend}.out", work / f"{model}-{frontend}.err"
    t0 = time.perf_counter()
    with open(logs[0], "w") as so, open(logs[1], "w") as se:
        proc = subprocess.Popen(
            [str(PYTHON[frontend]), __file__, "--child", model, frontend, str(out)],
            stdout=so,
            stderr=se,
            env=env,
            cwd=ROOT,
            preexec_fn=_limit(int(max_gb * GB)),
        )
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    # wait4: this child's own rusage (peak RSS, CPU time), not the sum over children
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    timed_out = not killer.is_alive()
    killer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    stdout, stderr = logs[0].read_text(), logs[1].read_text()
    row: dict[str, Any] = {
        "model": model,
        "frontend": frontend,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_gb": usage.ru_maxrss * 1024 / GB,
        "rc": proc.returncode,
        "max_gb": max_gb,
    }
    result = None
    for text in reversed(stdout.strip().splitlines()):
        if text.startswith("{"):
            result = json.loads(text)
            break
    if proc.returncode == 0 and result is not None:
        row.update(result)
    else:
        tail = [s for s in stderr.strip().splitlines() if not s.startswith("I1")][-3:]
        memory = any("MemoryError" in s or "std::bad_alloc" in s or "Cannot allocate" in s
                     for s in stderr.splitlines())  # fmt: skip
        row["failed"] = (
            f"killed after {timeout:.0f} s" if timed_out
            else f"out of memory under the {max_gb:g} GB address-space limit" if memory
            else f"exit {proc.returncode}: {' | '.join(tail)[-400:]}"
        )  # fmt: skip
    out.unlink(missing_ok=True)
    row["git"] = _git()
    row["load_average_at_end"] = list(os.getloadavg())
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | parameters | front-end | built on | export wall | CPU time | peak RSS | stages |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        params = f"{r['parameters'] / 1e6:,.0f}M" if "parameters" in r else ""
        if "failed" in r or "skipped" in r:
            why = r.get("failed") or r.get("skipped")
            lines.append(f"| {r['model']} | {params} | {r['frontend']} | | not done: {why} | | | |")
            continue
        rss = f"{r['peak_rss_gb']:.2f} GB"
        stages = ", ".join(f"{k} {v:.0f} s" for k, v in r["stages_s"].items())
        lines.append(
            f"| {r['model']} | {params} | {r['frontend']} | {r['built_on']} | "
            f"{r['wall_s']:.0f} s | {r['cpu_s']:.0f} s | {rss} | {stages} |"
        )
    return "\n".join(lines)


def _git() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout

    return {"commit": git("rev-parse", "HEAD").strip(), "dirty": bool(git("status", "--porcelain"))}


def _order(row: dict[str, Any]) -> tuple[int, int]:
    models = ("tiny", *MODELS)
    return models.index(row["model"]) if row["model"] in models else len(models), (
        FRONTENDS.index(row["frontend"]) if row["frontend"] in FRONTENDS else len(FRONTENDS)
    )


def _rows_of(f: str, result: dict[str, Any], source_git: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for row in result["rows"]:
        row = dict(row)
        if "skipped" in row:  # nothing was measured
            rows.append(row)
            continue
        if f in source_git:
            commit, _, tree = source_git[f].partition(":")
            row["git"] = {"commit": commit, "dirty": tree != "clean"}
        elif "git" not in row and "commit" in result.get("git", {}):
            row["git"] = result["git"]
        if "load_average_at_end" not in row:
            load = result["host"].get("load_average_at_end")
            if isinstance(load, list):
                row["load_average_at_end"] = load
        rows.append(row)
    return rows


def merge(
    files: list[str],
    source_git: dict[str, str],
    earlier: dict[str, str] | None = None,
    note: str = "",
) -> dict[str, Any]:
    """One results file of several runs' files: a later file's row replaces the same
    (model, front-end) row of an earlier one. A row without its own git record takes its
    file's, or ``source_git``'s for that file ("COMMIT:clean" or "COMMIT:dirty").
    ``earlier`` (label -> file) keeps rows measured for a comparison (the same row before
    a change) under ``earlier``, by label, out of the table (a merged file's own
    ``earlier`` is kept); a command already listed is not listed again; ``note`` says how the runs
    were made where their commands do not."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    commands: list[str] = []
    host: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    for f in files:
        result = json.loads(Path(f).read_text())
        commands += [c for c in result.get("commands") or [result["command"]] if c not in commands]
        kept.update(result.get("earlier", {}))  # a merged file's comparison rows stay
        host = {k: v for k, v in result["host"].items() if k in ("cpus", "machine")}
        for row in _rows_of(f, result, source_git):
            rows[(row["model"], row["frontend"])] = row
    ordered = sorted(rows.values(), key=_order)
    merged: dict[str, Any] = {
        "benchmark": "export_scale",
        **({"note": note} if note else {}),
        "commands": commands,
        "host": host,
        "rows": ordered,
        "table": table(ordered),
    }
    if kept:
        merged["earlier"] = kept
    for label, f in (earlier or {}).items():
        result = json.loads(Path(f).read_text())
        if result["command"] not in commands:
            commands.append(result["command"])
        merged.setdefault("earlier", {})[label] = _rows_of(f, result, source_git)
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--frontends", nargs="*", default=list(FRONTENDS))
    ap.add_argument("--skip", nargs="*", default=[], help="FRONTEND:MODEL rows not to run")
    ap.add_argument("--reason", nargs="*", default=[], help="FRONTEND:MODEL=why, per skip")
    ap.add_argument("--max-gb", type=float, default=12.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=str(HERE / "results" / "export_scale.json"))
    ap.add_argument(
        "--python", nargs="*", default=[], help="FRONTEND=PYTHON: the interpreter of a front-end"
    )
    ap.add_argument("--merge", nargs="*", default=[], help="results files to merge into --out")
    ap.add_argument(
        "--source-git", nargs="*", default=[], help="FILE=COMMIT:clean|dirty, per merged file"
    )
    ap.add_argument(
        "--earlier", nargs="*", default=[], help="LABEL=FILE: rows kept for a comparison"
    )
    ap.add_argument("--note", default="", help="how the merged runs were made")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.merge:
        merged = merge(
            args.merge,
            dict(g.split("=", 1) for g in args.source_git),
            dict(e.split("=", 1) for e in args.earlier),
            args.note,
        )
        Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
        print(merged["table"])
        return
    reasons = dict(r.split("=", 1) for r in args.reason)
    PYTHON.update({k: Path(v) for k, v in (p.split("=", 1) for p in args.python)})
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="stepbundle-export-scale-") as tmp:
        for model in args.models:
            for frontend in args.frontends:
                key = f"{frontend}:{model}"
                if key in args.skip:
                    rows.append(
                        {"model": model, "frontend": frontend,
                         "skipped": reasons.get(key, "not run")}
                    )  # fmt: skip
                    continue
                print(f"{key} ...", file=sys.stderr, flush=True)
                rows.append(run_row(model, frontend, Path(tmp), args.max_gb, args.timeout))
                print(f"  {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    result = {
        "benchmark": "export_scale",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_average_at_end": os.getloadavg(),
        },  # fmt: skip
        "git": _git(),
        "rows": rows,
        "table": table(rows),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(result["table"])


if __name__ == "__main__":
    main()
