"""A device profile's time by kind of operation, read against XLA's optimized HLO.

    python benchmarks/device/profile_categories.py NAME=OPS.json=HLO.txt [...] --out cats.json

``OPS.json`` is what ``trace_ops.summarize`` wrote for a program (``attention_table.py
bench --profile``, ``gpt.py bench --profile``: every operation of the device's "XLA Ops"
line, summed over 5 steps); ``HLO.txt`` is the same program's
``*.after_optimizations.txt`` (``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``
in the same run). Each top-level operation of the entry computation is put in one kind:

- ``matmul``: a fusion whose computation holds a convolution or a dot (XLA's TPU form of every
  matrix product), with what XLA fused into it (biases, casts, a norm's reductions);
- ``attention kernels``: the Pallas calls (``tpu_custom_call``);
- ``copy/transpose``: layout changes;
- ``async``: the ``-start``/``-done`` halves of asynchronous copies and slices;
- ``other``: element-wise and reduction fusions, scatters, broadcasts, reshapes.

Each kind is split again by whether the operation's result is vocabulary-shaped (a
dimension ``--vocab`` long, or the flat ``tokens x vocab`` array), which separates the
LM head and the loss from the rest. Per program it reports ms per step in each kind, the
number of operations, and the ``--top`` largest operations of the ``other`` kind with
their result types, which is where two programs of the same model differ most.

Imports: the standard library, stepbundle.runtime.compile.head_choice (its reading of HLO
text: computations and the products they hold).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path
from typing import Any

from stepbundle.runtime.compile.head_choice import CALLS as _CALLS
from stepbundle.runtime.compile.head_choice import computations
from stepbundle.runtime.compile.head_choice import holds_product as _holds_product

_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)$")


def categorize(ops: list[dict[str, Any]], hlo: str, vocab: int, steps: int, top: int) -> Any:
    comps = computations(hlo)
    entry = {}
    for line in comps.get("ENTRY", []):
        m = _INSTR.match(line)
        if m:
            entry[m.group(1)] = m.group(2)
    ms: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    other: collections.Counter[str] = collections.Counter()
    for r in ops:
        if r["line"] != "XLA Ops":
            continue
        op, line = r["op"], entry.get(r["op"], "")
        result = re.split(r" [\w\-]+\(", line, maxsplit=1)[0]  # the result's type(s)
        if any(_holds_product(comps, c, {c}) for c in _CALLS.findall(line)) or (
            " convolution(" in line
        ):
            kind = "matmul"
        elif "tpu_custom_call" in line:
            kind = "attention kernels"
        elif op.startswith(("copy", "transpose")):
            kind = "copy/transpose"
        elif "-start" in op or "-done" in op:
            kind = "async"
        else:
            kind = "other"
        big = str(vocab) in result or bool(re.search(r"\[\d{9,}\]", result))
        key = f"{kind}, vocab-shaped" if big else kind
        ms[key] += r["total_ms"] / steps
        count[key] += r["count"] // steps
        if kind == "other":
            family = re.sub(r"[.]\d+$", "", op)
            other[f"{family} -> {result.strip()[:80]}"] += r["total_ms"] / steps
    return {
        "device_ms_per_step": round(sum(ms.values()), 3),
        "kinds": {k: {"ms_per_step": round(v, 3), "ops": count[k]} for k, v in ms.most_common()},
        "largest_other": [[k, round(v, 3)] for k, v in other.most_common(top)],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("programs", nargs="+", metavar="NAME=OPS.json=HLO.txt")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--steps", type=int, default=5, help="steps the trace holds")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    report: dict[str, Any] = {}
    for spec in a.programs:
        name, ops, hlo = spec.split("=")
        report[name] = categorize(
            json.loads(Path(ops).read_text()), Path(hlo).read_text(), a.vocab, a.steps, a.top
        )
        print(f"== {name}: {report[name]['device_ms_per_step']:.2f} ms/step on the device")
        for kind, row in report[name]["kinds"].items():
            print(f"  {row['ms_per_step']:7.2f} ms {row['ops']:5d} ops  {kind}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
