"""Equivalence suite set-up: run each case once per session, collect the report table.

Each case trains three ways once (``equiv_runs``); the tests compare the runs and
record their worst differences. At the end of the session the table is printed and
written to build/equivalence-table.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from equiv_harness import (
    RUNS,
    TABLE_PATH,
    CaseRuns,
    record_float64,
    report_text,
    train_three_ways,
)
from equiv_models import CASES


@pytest.fixture(scope="session")
def equiv_runs(
    lean_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], CaseRuns]:
    """``equiv_runs(name)``: the case's three runs, trained on first use only."""

    def get(name: str) -> CaseRuns:
        if name not in RUNS:
            workdir = tmp_path_factory.mktemp("equiv")
            RUNS[name] = train_three_ways(CASES[name], lean_python, workdir)
            record_float64(RUNS[name])
        return RUNS[name]

    return get


def pytest_terminal_summary(terminalreporter: Any) -> None:
    text = report_text()
    if not text:
        return
    Path(TABLE_PATH).parent.mkdir(parents=True, exist_ok=True)
    Path(TABLE_PATH).write_text(text)
    terminalreporter.write_sep("=", "equivalence")
    terminalreporter.write_line(text)
    terminalreporter.write_line(f"(written to {TABLE_PATH})")
