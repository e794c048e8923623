"""The README's figures table is the one benchmarks/figures.py makes from the committed
results file (benchmarks/results/results.json): a figure cannot drift from its source."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import figures  # noqa: E402


def test_readme_table_is_generated_from_the_committed_results() -> None:
    results = json.loads(figures.RESULTS.read_text())
    want = figures.table(results)
    got = figures.current(figures.README.read_text())
    assert got == want, (
        "README.md's figures table differs from benchmarks/results/results.json; run "
        ".venv/bin/python benchmarks/figures.py --write"
    )


def test_the_table_has_every_case_and_the_stepbundle_row() -> None:
    results = json.loads(figures.RESULTS.read_text())
    table = figures.table(results)
    cases = {(r["case"], r["depth"]) for r in results["step_times"]}
    header = table.splitlines()[0]
    assert header.count("|") == len(cases) + 2
    row = next(line for line in table.splitlines() if "stepbundle `trainer.step`" in line)
    assert "-" not in row.split("|", 2)[2], "every case has a stepbundle figure"
    # A results file with another figure makes another table: the test has teeth.
    first = results["step_times"][0]
    first["median_ms"] = first["median_ms"] * 3 + 1
    assert figures.table(results) != table
