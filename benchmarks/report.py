"""Turn a results dict into the markdown report, the JSON file and the plot.

Imports: matplotlib (Agg), stdlib.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METHODS = (
    "torch_xla_lazy",
    "torch_xla_dynamo_model",
    "torch_xla_dynamo_step",
    "torch_eager",
    "torch_compile",
    "jax_jit",
    "stepbundle",
    "stepbundle_k8",
    "stepbundle_k32",
    "floor",
)
DIAGNOSTIC_METHODS = ("stepbundle_devbatch",)

TARGET_DEPTH = 32


def _fmt_ms(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}x" if x >= 100 else (f"{x:.1f}x" if x >= 10 else f"{x:.2f}x")


def _cases(records: Sequence[Mapping[str, Any]]) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []
    for r in records:
        key = (r["case"], r["depth"])
        if key not in seen:
            seen.append(key)
    return seen


def _lookup(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int, str], Mapping[str, Any]]:
    return {(r["case"], r["depth"], r["method"]): r for r in records}


def targets(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Issue #7's targets, each with its figure and whether it is met."""
    by = _lookup(records)
    out: list[dict[str, Any]] = []

    def ms(case: str, depth: int, method: str) -> float | None:
        r = by.get((case, depth, method))
        return None if r is None else float(r["median_ms"])

    sb, fl, lazy = (ms("mlp", TARGET_DEPTH, m) for m in ("stepbundle", "floor", "torch_xla_lazy"))
    if sb is not None and fl is not None:
        out.append(
            {
                "target": f"stepbundle <= 1.10x floor at MLP depth {TARGET_DEPTH}",
                "figure": sb / fl,
                "text": f"{sb / fl:.2f}x floor ({sb:.2f} vs {fl:.2f} ms)",
                "met": sb / fl <= 1.10,
            }
        )
    if sb is not None and lazy is not None:
        out.append(
            {
                "target": f"stepbundle >= 20x faster than torch_xla_lazy at MLP depth {TARGET_DEPTH}",
                "figure": lazy / sb,
                "text": f"{lazy / sb:.1f}x faster ({lazy:.1f} vs {sb:.2f} ms)",
                "met": lazy / sb >= 20.0,
            }
        )
    for depth in (4, TARGET_DEPTH):  # issue #17: against torch_xla's own compiled step
        sb4, dyn = ms("mlp", depth, "stepbundle"), ms("mlp", depth, "torch_xla_dynamo_step")
        if sb4 is not None and dyn is not None:
            out.append(
                {
                    "target": f"stepbundle >= 10x faster than torch_xla dynamo (whole step) "
                    f"at MLP depth {depth}",
                    "figure": dyn / sb4,
                    "text": f"{dyn / sb4:.1f}x faster ({dyn:.2f} vs {sb4:.2f} ms)",
                    "met": dyn / sb4 >= 10.0,
                }
            )
    for depth, limit in ((4, 0.3), (TARGET_DEPTH, 0.8)):  # issue #17
        k32, fl = ms("mlp", depth, "stepbundle_k32"), ms("mlp", depth, "floor")
        if k32 is not None and fl is not None:
            out.append(
                {
                    "target": f"stepbundle K=32 steps per call <= {limit}x the single-step "
                    f"floor at MLP depth {depth}",
                    "figure": k32 / fl,
                    "text": f"{k32 / fl:.2f}x floor ({k32:.3f} vs {fl:.3f} ms per step)",
                    "met": k32 / fl <= limit,
                }
            )
    for case, depth in _cases(records):
        s, e, j = (ms(case, depth, m) for m in ("stepbundle", "torch_eager", "jax_jit"))
        if case == "mlp" and depth >= 16 and s is not None and e is not None:
            out.append(
                {
                    "target": f"stepbundle faster than torch_eager at MLP depth {depth}",
                    "figure": e / s,
                    "text": f"{e / s:.2f}x ({s:.2f} vs {e:.2f} ms)",
                    "met": s < e,
                }
            )
        if s is not None and j is not None:
            out.append(
                {
                    "target": f"stepbundle within 1.2x of jax_jit ({case} depth {depth})",
                    "figure": s / j,
                    "text": f"{s / j:.2f}x jax_jit ({s:.2f} vs {j:.2f} ms)",
                    "met": s / j <= 1.2,
                }
            )
    return out


def load_targets(loads: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Issue #17's cold-start targets, from ``load_times`` of MLP depth TARGET_DEPTH."""
    out: list[dict[str, Any]] = []
    ld = next((r for r in loads if r["case"] == "mlp" and r["depth"] == TARGET_DEPTH), None)
    if ld is None or "cold_unpacked" not in ld:
        return out
    packed, unpacked = (
        ld[k]["load_stages_s"].get("compile", 0.0) for k in ("cold", "cold_unpacked")
    )
    if unpacked > 0:
        out.append(
            {
                "target": f"cold load's compile of the MLP depth-{TARGET_DEPTH} bundle <= 1.5x "
                "the unpacked program's",
                "figure": packed / unpacked,
                "text": f"{packed / unpacked:.2f}x ({packed:.2f} vs {unpacked:.2f} s; load to "
                f"first step {ld['cold']['load_to_first_step_s']:.2f} vs "
                f"{ld['cold_unpacked']['load_to_first_step_s']:.2f} s)",
                "met": packed / unpacked <= 1.5,
            }
        )
    warm = ld["warm"]["load_to_first_step_s"]
    samples = ld["warm"].get("warm_samples_s", [warm])
    out.append(
        {
            "target": f"warm load of the MLP depth-{TARGET_DEPTH} bundle (compile cache hit) <= 1 s",
            "figure": warm,
            "text": f"{warm:.2f} s to the first step's loss ({ld['warm']['load_s']:.2f} s load)"
            + (
                f", the median of {len(samples)} fresh processes "
                f"({min(samples):.2f}-{max(samples):.2f} s)"
                if len(samples) > 1
                else ""
            ),
            "met": warm <= 1.0,
        }
    )
    return out


def _first_step_table(loads: Sequence[Mapping[str, Any]]) -> list[str]:
    """Fresh process to first loss: stepbundle's lean process against torch_xla's."""
    rows = [r for r in loads if "cold_unpacked" in r]
    if not rows:
        return []
    lines = [
        "### Time to first step (fresh process, seconds)",
        "",
        "Each figure is one fresh process, from its start to the first training step's loss "
        "(interpreter start-up included: `process_wall_s`). stepbundle: a process without "
        "torch imports the runtime, loads the bundle (compiling it, or reading the compile "
        "cache) and runs one step. torch_xla: imports torch and torch_xla, builds the model "
        "and AdamW on the device, traces, compiles and runs one step (its persistent compile "
        "cache empty, then filled by the first process); its second step, in the same process, traces again and compiles again (the first step created AdamW's state, so the second step's graph is new). Export is a one-off cost, in the "
        "table above.",
        "",
        "| case | depth | stepbundle cold | stepbundle warm | stepbundle cold, unpacked "
        "| torch_xla cold | torch_xla warm cache | torch_xla's second step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r["case"], str(r["depth"])]
        for key in ("cold", "warm", "cold_unpacked", "torch_xla_cold", "torch_xla_warm"):
            cells.append(f"{r[key]['process_wall_s']:.2f}" if key in r else "-")
        cells.append(
            f"{r['torch_xla_cold']['second_step_s']:.2f}" if "torch_xla_cold" in r else "-"
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def markdown(results: Mapping[str, Any]) -> str:
    records = results["step_times"]
    by = _lookup(records)
    methods = [m for m in METHODS + DIAGNOSTIC_METHODS if any(r["method"] == m for r in records)]
    lines = []
    mach = results["machine"]
    git = results.get("git") or {}
    commit = git.get("commit")
    lines.append(
        f"Commit: {commit[:12] if commit else 'not recorded'}"
        + (" (with uncommitted changes)" if git.get("dirty") else "")
        + ". Times are wall-clock medians; the CPU time of this process (every thread, "
        "not other processes' time on the cores) is beside them in the second table."
    )
    lines.append("")
    lines.append(
        f"Machine: {mach['cpu']}, {mach['cpus']} CPUs, Python {mach['python']}, torch "
        f"{mach['torch']}, torch_xla {mach['torch_xla']}, jax {mach['jax']}. Mode: "
        f"{results['config']['mode']}, {results['config']['rounds']} interleaved rounds per "
        f"case; load average {mach['loadavg_start']} at start, {mach.get('loadavg_end', '?')} at end."
    )
    lines.append("")
    lines.append("### Step time (median ms; in brackets: x floor)")
    lines.append("")
    head = ["case", "depth", "graph inputs", *methods, "stepbundle speed-up vs torch_xla_lazy"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for case, depth in _cases(records):
        fl = by.get((case, depth, "floor"))
        row = [case, str(depth)]
        anyr = next(r for r in records if r["case"] == case and r["depth"] == depth)
        row.append(str(anyr.get("graph_inputs", "-")))
        for m in methods:
            r = by.get((case, depth, m))
            if r is None:
                row.append("-")
                continue
            cell = _fmt_ms(r["median_ms"])
            if fl is not None and m != "floor":
                cell += f" ({_ratio(r['median_ms'] / fl['median_ms'])})"
            row.append(cell)
        sb, lazy = by.get((case, depth, "stepbundle")), by.get((case, depth, "torch_xla_lazy"))
        row.append(_ratio(lazy["median_ms"] / sb["median_ms"]) if sb and lazy else "-")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("### Every method against floor and torch_xla_lazy")
    lines.append("")
    lines.append(
        "| case | depth | method | median ms | p25-p75 ms | steps/block | x floor "
        "| x torch_xla_lazy | CPU ms (process) | CPU x floor |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        fl = by.get((r["case"], r["depth"], "floor"))
        cpu = r.get("cpu_median_ms")
        cpu_ratio = cpu / fl["cpu_median_ms"] if cpu and fl and fl.get("cpu_median_ms") else None
        lines.append(
            f"| {r['case']} | {r['depth']} | {r['method']} | {_fmt_ms(r['median_ms'])} | "
            f"{_fmt_ms(r['p25_ms'])}-{_fmt_ms(r['p75_ms'])} | {r['steps_per_block']} | "
            f"{_ratio(r.get('ratio_to_floor'))} | {_ratio(r.get('ratio_to_torch_xla_lazy'))} | "
            f"{_fmt_ms(cpu)} | {_ratio(cpu_ratio)} |"
        )
    lines.append("")
    lines.append("### Targets (issue #7)")
    lines.append("")
    lines.append("| target | figure | met |")
    lines.append("|---|---|---|")
    for t in results["targets"]:
        lines.append(f"| {t['target']} | {t['text']} | {'yes' if t['met'] else '**no**'} |")
    lines.append("")
    diags = results.get("diagnostics") or []
    if diags:
        names: list[str] = []
        for d in diags:
            names += [r["method"] for r in d["records"] if r["method"] not in names]
        lines.append("### Where the time goes: dispatch, GC and per-buffer cost (diagnostics)")
        lines.append("")
        lines.append(
            "Median ms (x floor), interleaved like the main table; see benchmarks/README.md "
            "for what each variant is."
        )
        lines.append("")
        head = ["case", "depth", "buffers in/out", "packed in/out", *names]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for d in diags:
            f = d["facts"]
            by_m = {r["method"]: r for r in d["records"]}
            row = [
                d["case"],
                str(d["depth"]),
                f"{f['graph_inputs']}/{f['graph_outputs']}",
                f"{f['packed_inputs']}/{f['packed_outputs']}",
            ]
            for n in names:
                r = by_m.get(n)
                row.append(
                    f"{_fmt_ms(r['median_ms'])} ({_ratio(r['ratio_to_floor'])})" if r else "-"
                )
            lines.append("| " + " | ".join(row) + " |")
        for d in diags:
            if not d["profile"]:
                continue
            lines.append("")
            lines.append(
                f"cProfile of trainer.step, {d['case']} depth {d['depth']} (top functions by own "
                "time, microseconds per step; cProfile inflates Python-heavy code):"
            )
            lines.append("")
            lines.append("| function | calls/step | own us/step | cumulative us/step |")
            lines.append("|---|---|---|---|")
            for r in d["profile"][:8]:
                lines.append(
                    f"| `{r['function']}` | {r['calls_per_step']:.1f} | "
                    f"{r['own_us_per_step']:.0f} | {r['cumulative_us_per_step']:.0f} |"
                )
        lines.append("")
    lines.append("### Export and load")
    lines.append("")
    lines.append(
        "| case | depth | bundle MB | export s | load to first step, cold s | "
        "load to first step, warm cache s | compile s (cold) | compile s (cold, unpacked) "
        "| runtime import s |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    loads = {(r["case"], r["depth"]): r for r in results.get("load", [])}
    for e in results["export"]:
        ld = loads.get((e["case"], e["depth"]))
        cold = ld["cold"] if ld else None
        warm = ld["warm"] if ld else None
        lines.append(
            f"| {e['case']} | {e['depth']} | {e['bundle_bytes'] / 1e6:.2f} | {e['export_s']:.2f} | "
            + (f"{cold['load_to_first_step_s']:.2f}" if cold else "-")
            + " | "
            + (f"{warm['load_to_first_step_s']:.2f}" if warm else "-")
            + " | "
            + (f"{cold['load_stages_s'].get('compile', 0):.2f}" if cold else "-")
            + " | "
            + (
                f"{ld['cold_unpacked']['load_stages_s'].get('compile', 0):.2f}"
                if ld and "cold_unpacked" in ld
                else "-"
            )
            + " | "
            + (f"{cold['import_s']:.2f}" if cold else "-")
            + " |"
        )
    lines.append("")
    lines += _first_step_table(results.get("load", []))
    br = results.get("bundle_read")
    if br:
        lines.append("")
        lines.append(
            f"### Bundle read throughput ({br['state_bytes'] / 1e6:.0f} MB of state, "
            f"{br['file_bytes'] / 1e6:.0f} MB file: {br['model']})"
        )
        lines.append("")
        lines.append("| what | seconds | MB/s |")
        lines.append("|---|---|---|")
        for key, label in (
            (
                "read_evicted",
                "open_bundle + SHA-256 of every section, file evicted from page cache",
            ),
            ("read_cached", "open_bundle + SHA-256 of every section, file in page cache"),
            ("state_transfer", "runtime load: state sections to device arrays (digest + copy)"),
        ):
            v = br.get(key)
            if v:
                lines.append(f"| {label} | {v['seconds']:.3f} | {v['mb_per_s']:.0f} |")
    rss = results.get("peak_rss")
    if rss:
        lines.append("")
        lines.append(f"### Peak RSS ({rss['model']}, {rss['state_bytes'] / 1e6:.0f} MB of state)")
        lines.append("")
        lines.append(
            "| variant | RSS before load MB | peak while loading MB | RSS after load MB "
            "(of it file-backed) | RSS after gc.collect() MB | peak while stepping MB "
            "| RSS after the steps MB |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        for key in ("donate", "no_donate"):
            v = rss[key]
            lines.append(
                f"| {key.replace('_', ' ')} | {v['rss_before_load_kb'] / 1024:.0f} | "
                f"{v['peak_rss_load_kb'] / 1024:.0f} | {v['rss_after_load_kb'] / 1024:.0f} "
                f"({v['rss_file_after_load_kb'] / 1024:.0f}) | {v['rss_after_gc_kb'] / 1024:.0f} | "
                f"{v['peak_rss_steps_kb'] / 1024:.0f} | {v['rss_after_steps_kb'] / 1024:.0f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = results["step_times"]
    by = _lookup(records)
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    gpt = [(c, d) for c, d in _cases(records) if c != "mlp"]
    fig, axes = plt.subplots(
        1,
        2 if gpt else 1,
        figsize=(11 if gpt else 7, 4.5),
        squeeze=False,
        gridspec_kw={"width_ratios": [2, 1]} if gpt else None,
    )
    ax = axes[0][0]
    depths = sorted({d for c, d in _cases(records) if c == "mlp"})
    for m in methods:
        ys = [by[("mlp", d, m)]["median_ms"] for d in depths if ("mlp", d, m) in by]
        xs = [d for d in depths if ("mlp", d, m) in by]
        ax.plot(xs, ys, marker="o", label=m, linewidth=2.5 if m == "stepbundle" else 1.5)
    for name, style in (("floor_execute", ":"), ("packed_execute", "--")):
        pts = sorted(
            (d["depth"], r["median_ms"])
            for d in results.get("diagnostics") or []
            if d["case"] == "mlp"
            for r in d["records"]
            if r["method"] == name
        )
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                style,
                marker="x",
                color="gray" if name == "floor_execute" else "black",
                label=f"{name} (diagnostic)",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("MLP depth N (N x Linear(16)+LayerNorm+GELU, batch 32, AdamW)")
    ax.set_ylabel("median step time (ms, log scale)")
    ax.set_title("Step time vs depth")
    ax.grid(True, which="both", alpha=0.3)
    top = max(r["median_ms"] for r in records if r["case"] == "mlp")
    ax.set_ylim(top=top * 30)  # room for the legend above the curves
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    if gpt:
        ax2 = axes[0][1]
        case, depth = gpt[0]
        vals = [(m, by[(case, depth, m)]["median_ms"]) for m in methods if (case, depth, m) in by]
        ax2.bar(
            [m for m, _ in vals], [v for _, v in vals], color=[f"C{i}" for i in range(len(vals))]
        )
        ax2.set_yscale("log")
        ax2.set_ylim(min(v for _, v in vals) / 3, max(v for _, v in vals) * 2)
        for i, (_, v) in enumerate(vals):
            ax2.text(i, v * 1.08, _fmt_ms(v), ha="center", fontsize=7)
        ax2.set_title(f"small GPT ({depth} layers)")
        ax2.set_ylabel("median step time (ms, log scale)")
        ax2.tick_params(axis="x", rotation=45, labelsize=8)
        ax2.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle(results["machine"]["cpu"] + f", {results['machine']['cpus']} CPUs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: Mapping[str, Any], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "results.json",
        "markdown": out / "results.md",
        "plot": out / "step_time.png",
    }
    paths["json"].write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    paths["markdown"].write_text(markdown(results))
    plot(results, paths["plot"])
    return paths
