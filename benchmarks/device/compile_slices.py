"""Plan a TPU v5e slice without its chips: compile a bundle's train step for v5e-8 to
v5e-256 in each parallel layout and read XLA's memory plan and collectives per chip.

    # 1. the bundle: a Llama-style model, weights-free, one shape bucket per slice size
    #    (rows = chips: one sequence per chip in every layout), torch front-end
    .venv-torch/bin/python benchmarks/device/compile_slices.py export llama1b /tmp/l1b.stepbundle
    # 2. the compiles, each in a child process, with libtpu (jax[tpu]) and no TPU
    python benchmarks/device/compile_slices.py compile /tmp/l1b.stepbundle --model llama1b \\
        --slices v5e:2x4 v5e:4x4 v5e:8x8 v5e:16x16 --layouts dp zero1 fsdp fsdp+tp:4
    # 3. the markdown table (docs/parallel.md) from the results file
    python benchmarks/device/compile_slices.py table

``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:4x4")``
describes the chips of a slice; ``stepbundle.runtime.offline.compile_offline`` compiles the
bundle for them as ``load`` would (the same shard plan, mesh, packs, rewrites and compile
options; nothing placed, nothing loaded); ``+tp`` layouts split by ``LLAMA_TP_RULES``.
The bucket compiled is the one whose batch has as many rows as the slice has chips (one
2048-token sequence per chip). Per compile this records XLA's memory analysis of
one chip (``get_compiled_memory_stats``: arguments, outputs, the outputs aliased to donated
arguments, temporaries, generated code; the total is arguments + outputs - aliased +
temporaries + code, what the chip must hold at the peak, against the v5e's 16 GiB of HBM)
and the collectives of the partitioned program (``hlo_modules()``'s text: how many of each
of all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute, counting an
async ``-start`` once, and the bytes of their results). A compile libtpu refuses (a
program that does not fit the chip's memory is refused at compile time) is recorded with
libtpu's own message. Each compile runs in a child process whose resident memory is
watched (``--max-gb``: killed past it, and recorded so). ``--regather-weights on|off|auto``
is the runtime's ``regather_weights`` (``stablehlo/regather.py``, under ``fsdp`` and
``fsdp+tp``): ``on`` (the default here, as the rows before the runtime's "auto") gives
each later product of a split weight its own gathered copy, ``off``
(``--no-regather-weights``) compiles the program as written, ``auto`` (the runtime's
default) compiles it as written and again with the rewrite where libtpu refuses the first
for memory. Each row says which (``regather_weights``: true, false or "auto";
``regathered_products``: the products given a copy; ``regather_choice``: what "auto"
compared; rows compiled before the rewrite existed, e719f49, say null).

Rows accumulate in ``benchmarks/results/parallel_offline-v5e.json``: a run replaces the
rows of the (model, slice, layout, regather_weights) it measured.

Imports: jax (with libtpu), stepbundle; ``export`` imports torch and the torch front-end.
"""

from __future__ import annotations

import os

# libtpu reads these when it loads; without a TPU it has no metadata server to ask.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import argparse  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "parallel_offline-v5e.json"
GIB = 1 << 30
HBM = 16 * GIB  # a v5e chip
GB = 1e9
SLICES = ("v5e:2x4", "v5e:4x4", "v5e:8x8", "v5e:16x16")
LAYOUTS = ("dp", "zero1", "fsdp", "fsdp+tp:4")
# Megatron's split for llama.py's module names (DEFAULT_TP_RULES holds Hugging Face's and
# Meta's names, not these): q, k, v, gate and up on their outputs, o and down on their
# inputs, the embedding and the head on the vocabulary.
LLAMA_TP_RULES = (
    ("attn.q.weight", 0), ("attn.k.weight", 0), ("attn.v.weight", 0), ("attn.o.weight", 1),
    ("gate.weight", 0), ("up.weight", 0), ("down.weight", 1),
    ("embed.weight", 0), ("head.weight", 0),
)  # fmt: skip
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# an instruction: "%name = SHAPE opcode(" where SHAPE is an array or a tuple of arrays
_INSTRUCTION = re.compile(
    r"=\s+(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(", re.MULTILINE
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}  # fmt: skip


# ------------------------------------------------------------------------- export
def export(
    model: str, out: str, rows: list[int], layers: int | None = None, checkpointed: bool = False
) -> None:
    """Export ``model`` (``llama.py``'s sizes) weights-free with one shape bucket per
    entry of ``rows`` (global batch rows), the first one first; ``layers``: that many
    layers instead of the size's own (a study bundle of the same widths, whose program
    is small enough to compile where the whole model does not fit)."""
    import dataclasses

    import torch

    sys.path.insert(0, str(HERE.parent))
    import llama

    from stepbundle.export_torch import export as export_bundle

    cfg = dataclasses.replace(llama.SIZES[model], batch=rows[0])
    if layers is not None:
        cfg = dataclasses.replace(cfg, layers=layers)
    cfg = dataclasses.replace(cfg, checkpointed=checkpointed)
    recipe = llama.recipe(cfg)

    def batch(n: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (n, cfg.context + 1))
        return {"idx": tokens[:, :-1].contiguous(), "target": tokens[:, 1:].contiguous()}

    recipe = dataclasses.replace(recipe, example_batches=[batch(n) for n in rows[1:]])
    t0 = time.perf_counter()
    report = export_bundle(recipe, out, check=False, progress=lambda m: print(m, file=sys.stderr))
    print(
        json.dumps(
            {"model": model, "layers": cfg.layers, "rows": rows, "checkpointed": checkpointed,
             "export_s": time.perf_counter() - t0,
             "bytes": report.size, "stages_s": report.stage_seconds}
        )
    )  # fmt: skip


# ------------------------------------------------------------------------- child
def collectives(hlo: str) -> dict[str, dict[str, int]]:
    """Per collective kind, how many instructions the HLO text holds (an async pair
    counted once, at its ``-start``; XLA combines many small ones into one over a tuple)
    and the bytes of their results (every array of a combined one's tuple). An async
    ``-start``'s shape holds its operands and then its results (an all-gather's), with
    a collective-permute's two ``u32[]`` context words after them, which are not counted;
    an ``all-reduce-start``'s shape is its results alone. (Before 2026-12-07 a
    collective-permute-start counted only its context words: 0 bytes.)"""
    out = {c: {"count": 0, "bytes": 0} for c in COLLECTIVES}
    for shape, op, start in _INSTRUCTION.findall(hlo):
        arrays = _ARRAY.findall(shape)
        if start and op != "all-reduce":
            while arrays and arrays[-1] in (("u32", ""), ("s32", "")):  # context words
                arrays.pop()
            arrays = arrays[len(arrays) // 2 :]
        out[op]["count"] += 1
        out[op]["bytes"] += sum(_BYTES.get(dtype, 0) * _numel(dims) for dtype, dims in arrays)
    return out


def _numel(dims: str) -> int:
    n = 1
    for d in dims.split(","):
        if d:
            n *= int(d)
    return n


def child(bundle: str, topology: str, layout: str, regather: bool | str) -> dict[str, Any]:
    from jax.experimental import topologies

    from stepbundle.runtime import CompileOptions, LoadOptions, ParallelOptions, ShardRule
    from stepbundle.runtime.offline import compile_offline
    from stepbundle.schema import open_bundle

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    n = len(devices)
    with open_bundle(bundle) as b:
        programs = b.manifest.entries["train"].programs
        rows = [p.batch[0].spec.shape[0] for p in programs]
    if n not in rows:
        raise SystemExit(f"the bundle has no train bucket of {n} rows (it has {rows})")
    bucket = rows.index(n)
    rules = tuple(ShardRule(p, d) for p, d in LLAMA_TP_RULES) if "+tp" in layout else None
    options = LoadOptions(
        compile=CompileOptions(entries=("train",), regather_weights=regather),
        parallel=ParallelOptions(layout=layout, tp_rules=rules),
    )
    t0 = time.perf_counter()
    out = compile_offline(bundle, devices, options, buckets=[bucket])
    seconds = time.perf_counter() - t0
    label = f"train[{bucket}]"
    if label not in out.executables:
        return {"refused": out.refused[label], "rows": n}
    exe = out.executables[label]
    m = exe.get_compiled_memory_stats()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        + m.generated_code_size_in_bytes
    )
    hlo = "\n".join(mod.to_string() for mod in exe.hlo_modules())
    plan = out.placement.plan
    return {
        "rows": n,
        "compile_s": seconds,
        "mesh": dict(out.placement.mesh_axes),
        "split_state_tensors": len(plan.dims) if plan is not None else 0,
        "fused_attention": out.fused_attention.get(label, 0),
        "attention_kept": out.attention_kept.get(label, []),
        "regathered_products": out.regathered_products.get(label, 0),
        "regather_choice": out.regather_choice.get(label, ""),
        "layout_notes": list(plan.notes) if plan is not None else [],
        "memory": {
            "arguments": m.argument_size_in_bytes,
            "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes,
            "temporaries": m.temp_size_in_bytes,
            "generated_code": m.generated_code_size_in_bytes,
            "host_temporaries": m.host_temp_size_in_bytes,
            "total": total,
        },
        "fits_16gib": total <= HBM,
        "collectives": collectives(hlo),
        "collective_permute_bytes_counted": True,  # see collectives()
    }


# ------------------------------------------------------------------------- parent
def _rss_watch(proc: subprocess.Popen[bytes], limit: float, state: dict[str, Any]) -> None:
    """Kill ``proc`` when its resident memory passes ``limit`` bytes; keep the peak."""
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            text = status.read_text()
        except OSError:
            break
        found = re.search(r"VmRSS:\s+(\d+)", text)
        kb = int(found.group(1)) if found else 0
        state["peak"] = max(state.get("peak", 0), kb * 1024)
        if kb * 1024 > limit:
            state["killed"] = True
            proc.kill()
            break
        time.sleep(0.5)


def run_one(
    bundle: str,
    model: str,
    topology: str,
    layout: str,
    max_gb: float,
    timeout: float,
    regather: bool | str = True,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model": model,
        "slice": topology,
        "layout": layout,
        "regather_weights": regather,
    }
    tag = "" if regather is True else "-regather-" + _WORDS[regather]
    log = Path(f"/tmp/compile_slices-{model}-{topology.replace(':', '_')}-{layout}{tag}.err")
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, __file__, "child", bundle, topology, layout]
            + ["--regather-weights", _WORDS[regather]],
            stdout=subprocess.PIPE,
            stderr=err,
            env={
                **os.environ,
                "TPU_STDERR_LOG_LEVEL": "2",
                "TPU_MIN_LOG_LEVEL": "2",
                # libtpu takes a lockfile per host unless told that several processes may
                # load it (--jobs > 1, or another run beside this one): nothing runs here
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            },
        )
        watch: dict[str, Any] = {}
        watcher = threading.Thread(target=_rss_watch, args=(proc, max_gb * GB, watch))
        watcher.start()
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
            watch["timed_out"] = True
        watcher.join()
    row["wall_s"] = time.perf_counter() - t0
    row["peak_rss_gb"] = watch.get("peak", 0) / GB
    lines = [s for s in stdout.decode().splitlines() if s.startswith("{")]
    if proc.returncode == 0 and lines:
        row.update(json.loads(lines[-1]))
        return row
    text = log.read_text()
    oom = re.search(r"(RESOURCE_EXHAUSTED: [^\n]*|Ran out of memory[^\n]*)", text)
    if watch.get("killed"):
        row["failed"] = f"the compile passed {max_gb:g} GB of resident memory on this host"
    elif watch.get("timed_out"):
        row["failed"] = f"the compile took over {timeout:.0f} s"
    elif oom:
        row["failed"] = "libtpu: " + oom.group(1)[:600]
        row["fits_16gib"] = False
        used = re.search(r"Used ([0-9.]+[GMK]) of ([0-9.]+[GMK]) hbm", text)
        if used:
            row["hbm_used_by_compiler"], row["hbm_usable"] = used.group(1), used.group(2)
        # libtpu's report of the largest allocations follows its message
        row["libtpu_report"] = text[oom.start() : oom.start() + 3000]
    else:
        tail = [s for s in text.splitlines() if s.strip()][-3:]
        row["failed"] = f"exit {proc.returncode}: {' | '.join(tail)[-600:]}"
    return row


def _libtpu_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def _git() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout

    dirty = [s[3:] for s in git("status", "--porcelain").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "dirty_files": dirty}


def compile_all(a: argparse.Namespace) -> None:
    import jax

    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def one(topology: str, layout: str) -> None:
        print(f"{a.model} {topology} {layout} ...", file=sys.stderr, flush=True)
        regather = _regather_option(a)
        row = run_one(a.bundle, a.model, topology, layout, a.max_gb, a.timeout, regather)
        row["jax"], row["libtpu"] = jax.__version__, _libtpu_version()
        row["git"] = _git()
        row["host"] = {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "jobs": a.jobs}
        key = (a.model, topology, layout, regather)
        # read, replace the row, write: under a file lock, as runs of other models may
        # write the same file at the same time
        with lock, open(Path(tempfile.gettempdir()) / f"{path.name}.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            report = json.loads(path.read_text()) if path.exists() else {"rows": []}
            report["rows"] = [r for r in report["rows"] if _key(r) != key] + [row]
            report["target"] = "TPU v5e (16 GiB HBM per chip), compile-only: libtpu without a chip"
            path.write_text(json.dumps(report, indent=1) + "\n")
            print("  " + _line(row), file=sys.stderr, flush=True)

    # --jobs children at once (each compile is one process; libtpu uses several threads)
    with ThreadPoolExecutor(a.jobs) as pool:
        for f in [pool.submit(one, t, lay) for t in a.slices for lay in a.layouts]:
            f.result()


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    """What a row measured: a new row replaces the row of the same key."""
    return (r["model"], r["slice"], r["layout"], r.get("regather_weights"))


_WORDS: dict[bool | str, str] = {True: "on", False: "off", "auto": "auto"}


def _regather_option(a: argparse.Namespace) -> bool | str:
    """``regather_weights`` from ``--regather-weights`` and ``--no-regather-weights``."""
    if a.no_regather_weights:
        return False
    choice: dict[str, bool | str] = {"on": True, "off": False, "auto": "auto"}
    return choice[a.regather_weights]


def _regather(r: dict[str, Any]) -> str:
    """The table's words for a row's ``regather-weights``: the option, and under "auto"
    what was kept."""
    asked = r.get("regather_weights")
    if asked is None:
        return "(before)"  # compiled before the rewrite existed (e719f49)
    n = r.get("regathered_products")
    done = "off" if n == 0 or asked is False else ("on" if n is None else f"on ({n})")
    return f"auto: {done}" if asked == "auto" else done


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _line(r: dict[str, Any]) -> str:
    if "memory" not in r:
        return f"{r['slice']} {r['layout']}: {r.get('failed') or r.get('refused')}"
    m = r["memory"]
    return (
        f"{r['slice']} {r['layout']} regather {_regather(r)}: total {_gib(m['total'])} GiB (args {_gib(m['arguments'])}, "
        f"temp {_gib(m['temporaries'])}) compile {r['compile_s']:.0f} s"
    )


def _cell(r: dict[str, Any], k: str) -> str:
    """The table's cell of collective kind ``k`` of row ``r``: how many, and their bytes."""
    c = r["collectives"][k]
    if not c["count"]:
        return "0"
    if k == "collective-permute" and not r.get("collective_permute_bytes_counted"):
        return f"{c['count']} (? GiB)"  # counted as 0 bytes before 2026-12-07
    return f"{c['count']} ({c['bytes'] / GIB:.2f} GiB)"


def table(report: dict[str, Any]) -> str:
    names = {"v5e:2x4": "v5e-8", "v5e:4x4": "v5e-16", "v5e:8x8": "v5e-64", "v5e:16x16": "v5e-256"}
    lines = [
        "| model | slice | layout | regather-weights | arguments | temporaries | "
        "total per chip (GiB) | fits 16 GiB | all-gather | reduce-scatter | all-reduce | "
        "all-to-all | collective-permute |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def order(r: dict[str, Any]) -> tuple[Any, ...]:
        slices, layouts = list(names), list(LAYOUTS) + ["dp+tp:4", "zero1+tp:4"]
        return (
            r["model"],
            slices.index(r["slice"]) if r["slice"] in slices else len(slices),
            layouts.index(r["layout"]) if r["layout"] in layouts else len(layouts),
            {False: 0, True: 1, "auto": 2}.get(r.get("regather_weights"), 3),
        )

    for r in sorted(report["rows"], key=order):
        head = (
            f"| {r['model']} | {names.get(r['slice'], r['slice'])} | `{r['layout']}` | "
            f"{_regather(r)} |"
        )
        if "memory" not in r:
            if "hbm_used_by_compiler" in r:  # libtpu's refusal: what it would need
                usable = re.search(r"of ([0-9.]+[GMK]) hbm", r["failed"])
                lines.append(
                    f"{head} | | {r['hbm_used_by_compiler']} (libtpu) | no | refused by libtpu: "
                    f"over the {usable.group(1) if usable else '?'} usable | | | | |"
                )
                continue
            why = r.get("failed") or r.get("refused")
            lines.append(f"{head} | | | ? | not compiled: {why} | | | | |")
            continue
        m = r["memory"]
        counts = " | ".join(_cell(r, k) for k in COLLECTIVES)
        lines.append(
            f"{head} {_gib(m['arguments'])} | {_gib(m['temporaries'])} | {_gib(m['total'])} | "
            f"{'yes' if r['fits_16gib'] else 'no'} | {counts} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="export a Llama-style bundle (torch front-end)")
    e.add_argument("model")
    e.add_argument("out")
    e.add_argument("--rows", type=int, nargs="+", default=[8, 16, 64, 256])
    e.add_argument("--layers", type=int, default=None, help="instead of the size's own")
    e.add_argument(
        "--checkpointed",
        action="store_true",
        help="each layer under torch.utils.checkpoint (activation checkpointing)",
    )
    c = sub.add_parser("compile", help="compile for each slice and layout (libtpu)")
    c.add_argument("bundle")
    c.add_argument("--model", required=True)
    c.add_argument("--slices", nargs="+", default=list(SLICES))
    c.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    c.add_argument("--max-gb", type=float, default=10.0, help="per child")
    c.add_argument("--jobs", type=int, default=1, help="children at once")
    c.add_argument("--timeout", type=float, default=1800.0)
    c.add_argument("--out", default=str(RESULTS))
    c.add_argument(
        "--regather-weights",
        choices=("on", "off", "auto"),
        default="on",
        help="the runtime's regather_weights: on (default here), off, auto (the runtime's "
        "default: the rewrite only where libtpu refuses the program as written)",
    )
    c.add_argument(
        "--no-regather-weights",
        action="store_true",
        help="compile the program as written (--regather-weights off)",
    )
    t = sub.add_parser("table", help="print the markdown table of a results file")
    t.add_argument("--out", default=str(RESULTS))
    k = sub.add_parser("child")
    k.add_argument("bundle")
    k.add_argument("topology")
    k.add_argument("layout")
    k.add_argument("--regather-weights", choices=("on", "off", "auto"), default="on")
    k.add_argument("--no-regather-weights", action="store_true")
    a = p.parse_args()
    if a.command == "export":
        export(a.model, a.out, a.rows, a.layers, a.checkpointed)
    elif a.command == "compile":
        compile_all(a)
    elif a.command == "table":
        print(table(json.loads(Path(a.out).read_text())))
    else:
        print(json.dumps(child(a.bundle, a.topology, a.layout, _regather_option(a))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
