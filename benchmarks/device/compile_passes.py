"""Where a TPU compile spends its time, pass by pass, from libtpu's own log.

    TPU_VMODULE=hlo_pass_pipeline=1 TPU_MIN_LOG_LEVEL=0 TPU_STDERR_LOG_LEVEL=0 \\
        python benchmarks/device/compile_variants.py BUNDLE --platform tpu 2> log.txt
    python benchmarks/device/compile_passes.py log.txt --out passes.json

With ``hlo_pass_pipeline`` logging at level 1, XLA times every HLO pass it runs
(``HLO pass: NAME time: 1.39 s``; xla/hlo/pass/hlo_pass_pipeline.cc) and libtpu writes
the lines to stderr. ``compile_variants.py`` prints a marker before each variant's load;
this sums, per marker, the times of the passes run on the program (the module XLA calls
``main_module``; the runtime's state set-up compiles others), and the wall time from the
first to the last of them. What a compile spends after its last HLO pass (the TPU
backend's own lowering and scheduling) has no line here: it is the variant's compile
seconds less that wall time. Nested pipelines are timed as passes too, so a pass and the
pipeline around it both count: compare one pass across variants, not sums across passes.

Imports: the standard library.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

_LINE = re.compile(r"^I\d+ (\d+):(\d+):([\d.]+)\s+\d+ hlo_pass_pipeline\.cc:\d+\] (.*)$")
_PASS = re.compile(r"HLO pass: (.+?) time: ([\d.]+) (us|ms|s|min)\b")
_MODULE = re.compile(r"Running HLO pass pipeline on module (\S+?):")
_MARK = re.compile(r"^\[compile_variants\] (\S+) round (\d+)")
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}


def summarize(lines: list[str], top: int = 12) -> list[dict[str, object]]:
    """One row per marker: its passes' seconds on ``main_module``, largest first."""
    rows: list[dict[str, object]] = []
    passes: collections.Counter[str] = collections.Counter()
    module, first, last, name = "", None, None, None

    def close() -> None:
        if name is not None:
            rows.append(
                {
                    "variant": name,
                    "pass_seconds": round(sum(passes.values()), 3),
                    "passes_wall_s": None if first is None else round(last - first, 3),
                    "top_passes": [[k, round(v, 4)] for k, v in passes.most_common(top)],
                }
            )

    for line in lines:
        mark = _MARK.match(line)
        if mark:
            close()
            name = f"{mark.group(1)}/{mark.group(2)}"
            passes, module, first, last = collections.Counter(), "", None, None
            continue
        m = _LINE.match(line)
        if not m:
            continue
        h, mi, s, msg = m.groups()
        mod = _MODULE.search(msg)
        if mod:
            module = mod.group(1)
        if module != "main_module":
            continue
        t = int(h) * 3600 + int(mi) * 60 + float(s)
        first = t if first is None else first
        last = t
        p = _PASS.search(msg)
        if p:
            passes[p.group(1)] += float(p.group(2)) * _UNIT[p.group(3)]
    close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    rows = summarize(Path(a.log).read_text(errors="replace").splitlines(), a.top)
    for r in rows:
        tops = ", ".join(f"{k} {v:.3f}" for k, v in r["top_passes"][:3])  # type: ignore[index]
        print(
            f"{r['variant']:36s} passes {r['pass_seconds']:6.2f} s  wall {r['passes_wall_s']}  {tops}"
        )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
