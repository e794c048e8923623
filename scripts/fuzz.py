"""The long fuzzer: damaged golden bundles, many cases, every outcome checked.

    .venv-lean/bin/python scripts/fuzz.py                 # 20,000 cases on every core
    .venv-lean/bin/python scripts/fuzz.py --cases 2000 --jobs 1 --seed 7

It runs the mutation families of tests/hostile_fuzz.py (the bounded test in
tests/runtime/test_hostile_fuzz.py runs a few hundred of the same cases) through
hypothesis, with many examples and no shrinking: each damaged file is opened, every
section read and verified, then loaded with the runtime and stepped once. An outcome
other than a clean load or a BundleError, a case past the time limit, or a reader that
allocated more than the limit is a failure: it is printed with its traceback and the
damaged file is kept under --keep (default build/fuzz-failures) to reproduce it.

Prints the number of cases run, the outcomes by mutation family, and the failures;
exits 1 if there was any.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.cases`` cases in this process; return counts and failures."""
    from hostile_fuzz import (
        READER_ALLOCATION_LIMIT,
        HypothesisDraw,
        exercise,
        load_golden,
        mutate,
        time_limit,
    )
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st
    from runtime_helpers import GOLDEN_NAMES, golden_batches

    goldens = [load_golden(n) for n in GOLDEN_NAMES]
    batches = {n: golden_batches(n)[0] for n in GOLDEN_NAMES}
    work = Path(tempfile.mkdtemp(prefix="stepbundle-fuzz-"))
    keep = Path(args.keep)
    counts: collections.Counter[str] = collections.Counter()
    failures: list[dict[str, str]] = []
    cases = [0]

    @seed(args.seed)
    @settings(
        max_examples=args.cases,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def run(data: Any) -> None:
        case = mutate(HypothesisDraw(data), goldens)
        cases[0] += 1
        path = work / "case.stepbundle"
        path.write_bytes(case.data)
        try:
            with time_limit(args.case_seconds):
                outcome = exercise(
                    path,
                    load=not args.no_load,
                    cache_dir=work / "xla-cache",
                    batch=batches[case.golden],
                    stop_on_nonfinite=case.stop_on_nonfinite,
                )
            if outcome.reader_peak >= READER_ALLOCATION_LIMIT:
                raise AssertionError(f"the reader allocated {outcome.reader_peak} bytes")
            counts[f"{case.mutation}: {outcome.stage} {outcome.error or ''}".strip()] += 1
        except BaseException as e:  # a failure, whatever it is (also KeyboardInterrupt)
            keep.mkdir(parents=True, exist_ok=True)
            kept = keep / f"seed{args.seed}-case{cases[0]}.stepbundle"
            kept.write_bytes(case.data)
            failures.append(
                {
                    "case": case.description,
                    "file": str(kept),
                    "error": "".join(traceback.format_exception(e)),
                }
            )
            counts[f"{case.mutation}: FAILED {type(e).__name__}"] += 1
            if isinstance(e, KeyboardInterrupt):
                raise
        if args.progress and cases[0] % 1000 == 0:
            print(f"[fuzz seed {args.seed}] {cases[0]} cases", file=sys.stderr, flush=True)

    run()
    return {"cases": cases[0], "counts": dict(counts), "failures": failures}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=20_000, help="cases in all (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed of the first job")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    p.add_argument("--no-load", action="store_true", help="only the reader, not the runtime")
    p.add_argument("--case-seconds", type=float, default=60.0, help="time limit per case")
    p.add_argument("--keep", default=str(ROOT / "build" / "fuzz-failures"))
    p.add_argument("--progress", action="store_true", help="print a line every 1000 cases")
    p.add_argument("--worker", metavar="REPORT.json", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        Path(args.worker).write_text(json.dumps(_worker(args)))
        return 0

    t0 = time.perf_counter()
    jobs = max(1, min(args.jobs, args.cases))
    reports: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for j in range(jobs):
            n = args.cases // jobs + (1 if j < args.cases % jobs else 0)
            report = Path(tmp) / f"report{j}.json"
            cmd = [sys.executable, __file__, "--worker", str(report), "--cases", str(n)]
            cmd += ["--seed", str(args.seed + j), "--keep", args.keep]
            cmd += ["--case-seconds", str(args.case_seconds)]
            cmd += ["--no-load"] * args.no_load + ["--progress"] * args.progress
            procs.append((subprocess.Popen(cmd), report, args.seed + j))
        crashed = []
        for proc, report, job_seed in procs:
            if proc.wait() != 0 or not report.exists():
                # A worker that died (a signal, an abort in native code) is a failure too.
                crashed.append(f"worker with seed {job_seed} exited with {proc.returncode}")
            else:
                reports.append(json.loads(report.read_text()))
    seconds = time.perf_counter() - t0

    total = sum(r["cases"] for r in reports)
    counts: collections.Counter[str] = collections.Counter()
    failures: list[dict[str, str]] = []
    for r in reports:
        counts.update(r["counts"])
        failures.extend(r["failures"])
    print(f"stepbundle fuzz: {total} cases in {seconds:.0f} s ({jobs} jobs, seeds {args.seed}..)")
    for key, n in sorted(counts.items()):
        print(f"  {n:7d}  {key}")
    for f in failures:
        print(f"\nFAILED {f['case']}\n  kept as {f['file']}\n{f['error']}")
    for c in crashed:
        print(f"\nFAILED {c}")
    print(f"{total} cases, {len(failures) + len(crashed)} failures")
    return 1 if failures or crashed else 0


if __name__ == "__main__":
    sys.exit(main())
