"""The README's figures table, generated from a benchmark results file.

    .venv/bin/python benchmarks/figures.py [benchmarks/results/results.json]  # prints it
    .venv/bin/python benchmarks/figures.py --write                           # into README.md

The table sits in README.md between ``<!-- figures:begin -->`` and
``<!-- figures:end -->``; ``tests/test_readme_figures.py`` checks that it is the table
this script makes from the committed ``benchmarks/results/results.json``, so a figure in
the README cannot drift from the results it claims to come from.

Imports: the standard library only (no torch, no jax).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "results.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"

ROWS: Sequence[tuple[str, str]] = (
    ("torch_xla_lazy", "torch_xla, re-tracing every step"),
    ("torch_xla_dynamo_model", "torch_xla dynamo, `torch.compile(model, backend='openxla')`"),
    ("torch_xla_dynamo_step", "torch_xla dynamo, `torch.compile(step, backend='openxla')`"),
    ("torch_eager", "PyTorch eager (CPU)"),
    ("torch_compile", "`torch.compile` (inductor, CPU)"),
    ("jax_jit", "hand-written `jax.jit` + optax, donated"),
    ("stepbundle", "**stepbundle `trainer.step`**"),
    ("stepbundle_k8", "stepbundle, 8 steps per call (`--steps-per-call 8`), per step"),
    ("stepbundle_k32", "stepbundle, 32 steps per call, per step"),
    ("floor", "floor: bare call of the same executable"),
)
"""(method, row label) in table order; a method the results do not have is left out."""

CORNER = "AdamW; MLP: depth x (Linear(16, 16), LayerNorm, GELU), batch 32"
"""The table's top-left cell: the models the columns are (benchmarks/models.py)."""


def _ms(x: float) -> str:
    if x >= 100:
        return f"{x:.0f} ms"
    if x >= 10:
        return f"{x:.1f} ms"
    if x >= 0.1:
        return f"{x:.2f} ms"
    return f"{x:.3f} ms"


def table(results: Mapping[str, Any]) -> str:
    """The figures table (markdown) and the line saying which run it comes from."""
    records = results["step_times"]
    cases: list[tuple[str, int]] = []
    for r in records:
        if (r["case"], r["depth"]) not in cases:
            cases.append((r["case"], r["depth"]))
    cases.sort(key=lambda c: (c[0] != "mlp", c[1]))
    by = {(r["case"], r["depth"], r["method"]): r for r in records}
    head = [f"depth {d}" if c == "mlp" else "small GPT" for c, d in cases]
    lines = [
        f"| {CORNER} | " + " | ".join(head) + " |",
        "|---|" + "---|" * len(cases),
    ]
    for method, label in ROWS:
        if not any(r["method"] == method for r in records):
            continue
        cells = []
        for c, d in cases:
            r = by.get((c, d, method))
            cell = "-" if r is None else _ms(float(r["median_ms"]))
            cells.append(f"**{cell}**" if method == "stepbundle" and r is not None else cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += _first_step_rows(results.get("load") or [], cases)
    git = results.get("git") or {}
    commit = git.get("commit")
    where = (
        f"commit `{commit[:12]}`" + (" with uncommitted changes" if git.get("dirty") else "")
        if commit
        else "a commit the results file does not record"
    )
    mode = results["config"]["mode"]
    rounds = results["config"]["rounds"]
    lines.append("")
    lines.append(
        f"Wall-clock medians of {rounds} interleaved rounds ({mode} run, {where}); "
        "`benchmarks/results/results.md` has CPU-time medians beside them."
    )
    return "\n".join(lines) + "\n"


FIRST_STEP_ROWS: Sequence[tuple[str, str]] = (
    ("cold", "time to first step, fresh lean process, compile cache empty"),
    ("warm", "time to first step, fresh lean process, compile cache warm"),
    ("torch_xla_cold", "time to first step, torch_xla (import, trace, compile)"),
)
"""(load_times key, row label): fresh processes to the first loss, interpreter included."""


def _first_step_rows(
    loads: Sequence[Mapping[str, Any]], cases: Sequence[tuple[str, int]]
) -> list[str]:
    by = {(r["case"], r["depth"]): r for r in loads}
    rows = []
    for key, label in FIRST_STEP_ROWS:
        cells = []
        for c in cases:
            r = by.get(c, {}).get(key)
            wall = None if r is None else r.get("process_wall_s")  # older results lack it
            cells.append("-" if wall is None else f"{float(wall):.1f} s")
        if any(x != "-" for x in cells):
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def replace_in(readme: str, new_table: str) -> str:
    """``readme`` with the text between the markers replaced by ``new_table``."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + new_table + readme[end:]


def current(readme: str) -> str:
    """The table the README holds now (between the markers)."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:end].lstrip("\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", default=str(RESULTS))
    ap.add_argument("--write", action="store_true", help="write the table into README.md")
    args = ap.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    text = table(results)
    if args.write:
        README.write_text(replace_in(README.read_text(), text))
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
