"""Where a step's time goes on the device: a jax profiler trace summed by operation.

    python benchmarks/device/trace_ops.py TRACE_DIR [--top 25] [--out ops.json]

``jax.profiler`` writes ``*.trace.json.gz`` (Chrome trace events) beside its XPlane file;
on a TPU its device process has a line of XLA operations (fusions, convolutions, copies),
each event with its duration. This reads that JSON with the standard library (no xprof or
TensorBoard on the device machine), sums the time of every operation name per process
and line, and prints the largest, with the HLO text the trace attaches when it does
(``long_name``), so one device call can say what a step spends its time on.
``benchmarks/device/gpt.py bench --profile DIR`` calls it on its own traces.

Imports: the standard library.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path
from typing import Any


def summarize(trace_dir: str | Path, top: int | None = 25) -> list[dict[str, Any]]:
    """The ``top`` operations (None: all) by total time in every trace under ``trace_dir``."""
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    total: collections.Counter[tuple[str, str, str]] = collections.Counter()
    count: collections.Counter[tuple[str, str, str]] = collections.Counter()
    detail: dict[tuple[str, str, str], str] = {}
    for f in files:
        with gzip.open(f, "rt") as fh:
            events = json.load(fh).get("traceEvents", [])
        procs: dict[Any, str] = {}
        lines: dict[tuple[Any, Any], str] = {}
        for e in events:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                procs[e["pid"]] = e["args"]["name"]
            elif e.get("ph") == "M" and e.get("name") == "thread_name":
                lines[(e["pid"], e.get("tid"))] = e["args"]["name"]
        for e in events:
            if e.get("ph") != "X":
                continue
            key = (
                procs.get(e["pid"], str(e["pid"])),
                lines.get((e["pid"], e.get("tid")), str(e.get("tid"))),
                e.get("name", "?"),
            )
            total[key] += float(e.get("dur", 0.0))
            count[key] += 1
            args = e.get("args") or {}
            if key not in detail and "long_name" in args:
                detail[key] = str(args["long_name"])[:300]
    rows = []
    for (proc, line, name), us in total.most_common(top):
        rows.append(
            {
                "process": proc,
                "line": line,
                "op": name,
                "total_ms": us / 1e3,
                "count": count[(proc, line, name)],
                "hlo": detail.get((proc, line, name)),
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = summarize(a.trace_dir, a.top)
    for r in rows:
        print(
            f"{r['total_ms']:9.3f} ms {r['count']:6d}x  {r['process'][:18]:18s} "
            f"{r['line'][:16]:16s} {r['op'][:60]}"
        )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
