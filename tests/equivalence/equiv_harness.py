"""Train one case three (four) ways, compare the runs, and keep the numbers for the report.

(a) torch_xla eagerly, (b) the exported bundle in the lean process (newest jax, no
torch), (c) plain PyTorch on the CPU, and (d) the same in float64, the ground truth, all
from the same initial state and the same batches; ``tests/support.py`` does the
training, this module orchestrates and compares.

(b) is compared with (a) as exported with ``Recipe(numerics="torch_xla")``: that bundle
keeps torch_xla's BatchNorm ops, the ones (a) runs. XLA expands them with the variance as
E[x^2] - E[x]^2, whose cancellation amplifies any rounding difference between two XLA
builds, so this comparison is only as stable as those ops (it held here, with 1 and 2
CPUs, on jax 0.10.2; CI once saw resnet18's step-2 loss 1.6e-4 apart). (b) is compared
with (c) and (d) as exported by default, with PyTorch's BatchNorm numerics, which do not
amplify: the report's float64 columns show how near each run comes to the ground truth.

A case with dropout is exported twice: with dropout, compared against (a) under the
same RNG seed, and with dropout disabled, compared against (c), whose random numbers
come from another generator.

The lean processes run in background threads while this process exports and trains
(a) and (c): on a 2-core machine that overlaps their XLA compiles with ours.

How runs are compared (the bounds are in ``equiv_models.Bounds``):

- every metric at every step, element by element: |got - ref| / max(|ref|, 1e-6);
- every state tensor at the end (parameters, buffers, optimizer state, and the
  gradients the step leaves behind): floating tensors by their normwise relative
  error ||got - ref||_2 / ||ref||_2, integer and bool tensors exactly.

Why normwise for state: an element-by-element relative error is dominated by elements
near zero whose value is rounding noise (a gradient that cancels to ~1e-8, a weight that
crosses zero), and Adam's normalised update m / (sqrt(v) + eps) makes the next weight
depend on ratios of such tiny gradients, so single elements legitimately differ by
~lr across compilers (measured up to 1e-2 element-wise with a 1e-6 floor on the tiny
GPT, between two XLA versions running the same program) while every tensor agrees to
1e-5 as a whole.

Values alone cannot see every lost update: a weight that moves by 1e-5 of itself per
step (resnet's BatchNorm scales at a small lr) would match within 1e-5 with its last
update missing. So each parameter and buffer is also compared by the share of its
movement during training that the runs disagree on, ||got - ref|| / ||ref - initial||,
which a lost update of one step puts near 1/K.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from equiv_models import CASES, METRIC_FLOOR, Bounds, Case
from support import (
    Run,
    export_recipe,
    make_batches,
    max_rel_diff,
    run_bundle_lean,
    train_eager_cpu,
    train_eager_xla,
)

from stepbundle.exporter import Recipe
from stepbundle.runtime.train.schedule import parse_schedule

ROOT = Path(__file__).resolve().parents[2]
TABLE_PATH = ROOT / "build" / "equivalence-table.md"


@dataclass
class CaseRuns:
    """What one case produced."""

    case: Case
    xla: Run  # (a)
    bundle: Run  # (b), the recipe of (a), exported with numerics="torch_xla"
    cpu: Run  # (c)
    bundle_cpu: Run  # (b) of the recipe compared with (c): dropout-free, default numerics
    f64: Run | None = None  # (d), the recipe of (c) in float64; None without case.float64
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    bundle_path: Path | None = None  # the bundle (b) ran: tests that run it otherwise reuse it


def with_numerics(recipe_fn: Callable[[], Recipe], numerics: str) -> Callable[[], Recipe]:
    """The recipe exported with ``Recipe(numerics=numerics)``."""

    def make() -> Recipe:
        return dataclasses.replace(recipe_fn(), numerics=numerics)

    return make


def on_cpu(recipe_fn: Callable[[], Recipe]) -> Callable[[], Recipe]:
    """The recipe as plain PyTorch runs it on the CPU.

    torch refuses ``capturable=True`` (which the exporter needs) on the CPU; without
    it Adam computes the same update with its step count on the host.
    """

    def make() -> Recipe:
        r = recipe_fn()
        for g in r.optimizer.param_groups:
            if g.get("capturable"):
                g["capturable"] = False
        return r

    return make


def _slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def train_three_ways(case: Case, lean_python: str, workdir: Path) -> CaseRuns:
    """Export the case (twice when it has dropout or BatchNorm) and run (a) to (d).

    The bundle compared with torch_xla eager (a) is exported with ``numerics="torch_xla"``:
    it keeps torch_xla's BatchNorm ops, so it computes what (a) computes. The bundle
    compared with the CPU, (c) and (d), is exported with the default numerics (PyTorch's).
    Without BatchNorm the two exports are the same program, and one serves both.
    """
    t0 = time.perf_counter()
    stages: dict[str, float] = {}
    sched_fn: Callable[[int], float] | None = None
    if case.schedule is not None:
        base, offset = parse_schedule(case.schedule), case.schedule_offset

        def sched_fn(k: int) -> float:
            return base(k + offset)

    lean_kw: dict[str, Any] = {
        "schedule": case.schedule,
        "schedule_offset": case.schedule_offset,
    }
    batches = make_batches(case.recipe(), case.n_batches)
    slug = _slug(case.name)
    with ThreadPoolExecutor(max_workers=2) as pool:

        def run_lean(path: Path, sub: str, seed: int | None) -> Future[Run]:
            (workdir / sub).mkdir(exist_ok=True)
            return pool.submit(
                run_bundle_lean, lean_python, path, batches, case.steps, workdir / sub,
                seed=seed, **lean_kw,
            )  # fmt: skip

        nodrop = case.nodrop_recipe or case.recipe
        t = time.perf_counter()
        path = workdir / f"{slug}.stepbundle"
        report = export_recipe(nodrop, path)
        stages["export"] = time.perf_counter() - t
        bundle_cpu_f = run_lean(path, "b", case.seed if case.nodrop_recipe is None else None)
        bundle_f = bundle_cpu_f
        if case.nodrop_recipe is not None or report.numerics_rewrites:
            t = time.perf_counter()
            path2 = workdir / f"{slug}-torch-xla-numerics.stepbundle"
            export_recipe(with_numerics(case.recipe, "torch_xla"), path2)
            stages["export (for torch_xla)"] = time.perf_counter() - t
            bundle_f = run_lean(path2, "b-xla", case.seed)
        t = time.perf_counter()
        xla = train_eager_xla(case.recipe, batches, case.steps, seed=case.seed, schedule=sched_fn)
        stages["torch_xla"] = time.perf_counter() - t
        t = time.perf_counter()
        cpu_fn = on_cpu(case.cpu_recipe or nodrop)
        cpu = train_eager_cpu(cpu_fn, batches, case.steps, schedule=sched_fn)
        stages["cpu"] = time.perf_counter() - t
        f64 = None
        if case.float64:
            t = time.perf_counter()
            f64 = train_eager_cpu(cpu_fn, batches, case.steps, schedule=sched_fn, float64=True)
            stages["cpu float64"] = time.perf_counter() - t
        t = time.perf_counter()
        bundle, bundle_cpu = bundle_f.result(), bundle_cpu_f.result()
        stages["wait for the lean runs"] = time.perf_counter() - t
    seconds = time.perf_counter() - t0
    b_path = path2 if bundle_f is not bundle_cpu_f else path
    return CaseRuns(case, xla, bundle, cpu, bundle_cpu, f64, seconds, stages, b_path)


# ------------------------------------------------------------------- comparing


def normwise_rel(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref||_2 / ||ref||_2 in float64 (0 when both are 0)."""
    g = np.asarray(got, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    if g.shape != r.shape:
        raise AssertionError(f"shape mismatch {got.shape} vs {ref.shape}")
    num = float(np.linalg.norm(g - r))
    if num == 0.0:
        return 0.0
    den = float(np.linalg.norm(r))
    return num / den if den > 0 else float("inf")


@dataclass
class Comparison:
    """The worst differences between two runs, and every bound they broke."""

    worst_metric: float = 0.0
    worst_metric_at: str = ""
    worst_state: float = 0.0
    worst_state_at: str = ""
    # Tensors under a bound of their own: pattern -> (worst difference, that bound).
    worst_own_bound: dict[str, tuple[float, float]] = field(default_factory=dict)
    worst_update: float = 0.0
    worst_update_at: str = ""
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """``metrics / state``, then the tensors that have their own bound, if any."""
        text = f"{self.worst_metric:.1e} / {self.worst_state:.1e} / {self.worst_update:.1e}"
        for pattern, (d, rtol) in sorted(self.worst_own_bound.items()):
            text += f"; {pattern}: {d:.1e} (own bound {rtol:.2g})"
        return text

    def where(self) -> str:
        """Where the worst differences are."""
        return (
            f"metric: {self.worst_metric_at or '-'}; state: {self.worst_state_at or '-'}; "
            f"update: {self.worst_update_at or '-'}"
        )


def compare(
    got: Run,
    ref: Run,
    bounds: Bounds,
    what: str,
    aliases: dict[str, str] | None = None,
    initial: dict[str, np.ndarray] | None = None,
) -> Comparison:
    """Compare every metric at every step and every state tensor at the end.

    ``aliases`` maps a second name of a tied tensor to its primary name: the runtime's
    state_dict lists a tied weight under each of its names (as module.state_dict()
    does), and each of them must equal the reference's one tensor.

    ``initial``: parameters and buffers before training. Each one that moved is also
    compared by how much of its movement the two runs disagree on,
    ||got - ref|| / ||ref - initial|| (bounded by ``bounds.update_rtol``): a weight
    that moves by 1e-5 of itself per step (resnet's BatchNorm scales at a small lr)
    would pass a 1e-5 comparison of values even with its last update missing, and
    fails this one.
    """
    out = Comparison()
    if aliases:
        ref = Run(ref.metrics, {**ref.state, **{a: ref.state[p] for a, p in aliases.items()}})
    if len(got.metrics) != len(ref.metrics):
        out.failures.append(f"{len(got.metrics)} steps against {len(ref.metrics)}")
        return out
    for i, (g, r) in enumerate(zip(got.metrics, ref.metrics)):
        if set(g) != set(r):
            out.failures.append(f"step {i}: metrics {sorted(g)} against {sorted(r)}")
            continue
        for k in r:
            if not (np.isfinite(g[k]) and np.isfinite(r[k])):
                out.failures.append(f"step {i} metric {k}: {g[k]!r} against {r[k]!r}")
                continue
            d = max_rel_diff(np.array(g[k]), np.array(r[k]), METRIC_FLOOR)
            if d > out.worst_metric:
                out.worst_metric, out.worst_metric_at = d, f"step {i} {k}"
            if d > bounds.metric_rtol:
                out.failures.append(
                    f"step {i} metric {k}: {g[k]!r} against {r[k]!r} "
                    f"(relative {d:.3g} > {bounds.metric_rtol:g})"
                )
    # Gradients the step throws away and rebuilds every time (zero_grad(set_to_none=True)
    # before backward) are not state of a bundle; everything else must be there.
    missing = sorted(k for k in set(ref.state) - set(got.state) if not k.endswith(".grad"))
    # Empty placeholders hold nothing to compare (syncfree AdamW keeps a 0-element
    # max_exp_avg_sq without amsgrad; torch's AdamW, its CPU counterpart, keeps none).
    extra = sorted(k for k in set(got.state) - set(ref.state) if got.state[k].size)
    if missing or extra:
        out.failures.append(f"state names differ: missing {missing[:8]}, extra {extra[:8]}")
    for name in sorted(set(ref.state) & set(got.state)):
        g, r = got.state[name], ref.state[name]
        if g.shape != r.shape:
            out.failures.append(f"state {name}: shape {g.shape} against {r.shape}")
            continue
        if r.dtype.kind in "biu":
            if not np.array_equal(g, r):
                out.failures.append(f"state {name}: {g.ravel()[:4]} against {r.ravel()[:4]}")
            continue
        d = normwise_rel(g, r)
        if not np.isfinite(d):
            d = float("inf")
        rtol, why = bounds.state_bound(name)
        pattern = bounds.override_for(name)
        if pattern is not None:
            prev = out.worst_own_bound.get(pattern, (0.0, rtol))[0]
            out.worst_own_bound[pattern] = (max(prev, d), rtol)
        elif d > out.worst_state:
            out.worst_state, out.worst_state_at = d, name
        if not d <= rtol:
            out.failures.append(
                f"state {name}: normwise relative difference {d:.3g} > {rtol:g} ({why})"
            )
        init = (initial or {}).get(aliases.get(name, name) if aliases else name)
        if init is None or pattern is not None:
            continue
        moved = float(np.linalg.norm(np.asarray(r, np.float64) - init))
        if moved == 0.0:
            continue
        u = float(np.linalg.norm(np.asarray(g, np.float64) - r)) / moved
        u = u if np.isfinite(u) else float("inf")
        if u > out.worst_update:
            out.worst_update, out.worst_update_at = u, name
        if bounds.update_rtol is not None and not u <= bounds.update_rtol:
            out.failures.append(
                f"state {name}: the runs disagree on {u:.3g} of its movement during "
                f"training (> {bounds.update_rtol:g})"
            )
    return out


def check_failures(c: Comparison, bounds: Bounds, what: str) -> None:
    """Fail with every broken bound and the reason for the bounds."""
    if c.failures:
        lines = "\n  ".join(c.failures[:20])
        raise AssertionError(
            f"{what}: {len(c.failures)} difference(s) beyond the bounds\n  {lines}\n"
            f"Bounds: metrics {bounds.metric_rtol:g} relative per element, state "
            f"{bounds.state_rtol:g} normwise per tensor. Why: {bounds.reason}"
        )


# --------------------------------------------------------------------- report

#: Each case's runs, trained once per session (see conftest.equiv_runs).
RUNS: dict[str, CaseRuns] = {}
#: The report table's rows, by case name.
ROWS: dict[str, dict[str, Any]] = {}


def record(case: Case, column: str, value: str) -> None:
    """Put one cell of the report table."""
    row = ROWS.setdefault(case.name, {"case": case.name, "steps": case.steps, "seconds": 0.0})
    row[column] = value
    if case.name in RUNS:
        row["seconds"] = RUNS[case.name].seconds


_AGAINST = {"b_vs_a": "torch_xla", "b_vs_c": "the CPU", "b_vs_d": "the CPU in float64"}


def check_and_record(
    got: Run, ref: Run, case: Case, against: str, truth: Run | None = None
) -> Comparison:
    """Compare (b) with the reference, record the worst differences, then assert.

    Against torch_xla (a) the bounds are ``case.xla``; against PyTorch on the CPU, in
    float32 (c) or float64 (d), ``case.cpu``: float32 bounds either way, since PyTorch
    float32 itself is that near float64 (the report's (c) vs (d) column shows it).

    ``truth``: (d), when float64 decides differences beyond the bounds (see
    ``Case.float64_arbiter``); without it every difference beyond the bounds fails.
    """
    bounds = case.xla if against == "b_vs_a" else case.cpu
    what = f"{case.name}, bundle against {_AGAINST[against]}"
    c = compare(got, ref, bounds, what, tied_aliases(case), initial_state(case))
    verdict = " FAILED" if c.failures else ""
    if c.failures and truth is not None:
        assert case.float64_arbiter is not None and case.nodrop_recipe is None
        problems = arbitrate(
            got, ref, truth, bounds, case.cpu, tied_aliases(case), initial_state(case), what
        )
        if problems:
            lines = "\n  ".join(problems[:20] + c.failures[:10])
            raise AssertionError(
                f"{what}: the runs disagree beyond the bounds and PyTorch float64 does not "
                f"side with the bundle:\n  {lines}\nWhy float64 decides here: "
                f"{case.float64_arbiter}"
            )
        verdict = " (beyond the bounds; float64 shows torch_xla is the one off)"
    record(case, against, c.summary() + verdict)
    record(case, against + "_where", c.where())
    if truth is None:
        check_failures(c, bounds, what)
    return c


def arbitrate(
    got: Run,
    ref: Run,
    truth: Run,
    bounds: Bounds,
    truth_bounds: Bounds,
    aliases: dict[str, str],
    initial: dict[str, np.ndarray],
    what: str,
) -> list[str]:
    """Why a disagreement of ``got`` (the bundle) and ``ref`` is not ``ref``'s error ([]: it is).

    The bundle must be within ``truth_bounds`` of the float64 run ``truth``, and nearer to
    it than ``ref`` on every metric and state tensor where the two broke ``bounds``
    (tensors under one of ``truth_bounds``' own overrides, where both float32 runs differ
    from PyTorch by design, are held to the first condition only).
    Runs without dropout only: ``truth`` must have seen the same computation.
    """
    t_state = {**truth.state, **{a: truth.state[p] for a, p in aliases.items()}}
    # The bundle arbitrated is exported with numerics="torch_xla": its running variances,
    # like torch_xla's, take the biased batch variance, PyTorch's (float64 here) the
    # unbiased one, n / (n - 1) larger. Both float32 runs differ from float64 there by
    # design, so float64 cannot say which is right. They are held to torch_xla's instead,
    # on their movement: the batch variances under them are what the two XLAs compute
    # apart (the cancelling E[x^2] - E[x]^2 float64 decides against torch_xla on the
    # other tensors), so a few 1e-4 normwise is expected, while a running variance not
    # written back is 100% of its movement off (the default export's are held to float64
    # at 1e-4 in test_resnet18_matches_pytorch_float64).
    problems = []
    for k, v in sorted(got.state.items()):
        if not k.endswith("running_var") or k not in ref.state or k not in initial:
            continue
        r64 = np.asarray(ref.state[k], np.float64)
        moved = float(np.linalg.norm(r64 - initial[k]))
        off = float(np.linalg.norm(np.asarray(v, np.float64) - r64)) / max(moved, 1e-30)
        if off > (bounds.update_rtol or bounds.state_bound(k)[0]):
            problems.append(
                f"state {k}: bundle and torch_xla disagree on {off:.3g} of its movement; "
                "float64 cannot arbitrate a running variance both update with the biased "
                "batch variance by design"
            )
    t_state = {k: v for k, v in t_state.items() if not k.endswith("running_var")}
    judged = Run(got.metrics, {k: v for k, v in got.state.items() if k in t_state})
    vs_truth = compare(judged, Run(truth.metrics, t_state), truth_bounds, what, None, initial)
    problems += [f"against PyTorch float64: {f}" for f in vs_truth.failures]
    for i, (g, r, t) in enumerate(zip(got.metrics, ref.metrics, truth.metrics)):
        for k in r:
            d = max_rel_diff(np.array(g[k]), np.array(r[k]), METRIC_FLOOR)
            if d > bounds.metric_rtol and not abs(g[k] - t[k]) <= abs(r[k] - t[k]):
                problems.append(
                    f"step {i} metric {k}: bundle {g[k]!r}, torch_xla {r[k]!r}, float64 "
                    f"{t[k]!r}: the bundle is the farther one"
                )
    for name in sorted(set(got.state) & set(ref.state) & set(t_state)):
        g, r = got.state[name], ref.state[name]
        t = np.asarray(t_state[name], np.float64)
        if r.dtype.kind != "f" or truth_bounds.override_for(name) is not None:
            continue
        rtol, _ = bounds.state_bound(name)
        moved = float(np.linalg.norm(t - initial[name])) if name in initial else 0.0
        diff = float(np.linalg.norm(np.asarray(g, np.float64) - np.asarray(r, np.float64)))
        broke = normwise_rel(g, r) > rtol or (
            bounds.update_rtol is not None and moved > 0 and diff / moved > bounds.update_rtol
        )
        d_got = float(np.linalg.norm(np.asarray(g, np.float64) - t))
        d_ref = float(np.linalg.norm(np.asarray(r, np.float64) - t))
        if broke and not d_got <= d_ref:
            problems.append(
                f"state {name}: bundle and torch_xla disagree beyond the bounds, and the "
                f"bundle is the farther from float64 ({d_got:.3g} against {d_ref:.3g})"
            )
    return problems


def record_float64(runs: CaseRuns) -> None:
    """The report's float64 columns: (a), (b) and (c) each against (d).

    Recorded, not asserted (``assert_matches_float64`` asserts (b) for the cases whose
    tests call it). (a) trains the recipe with dropout where the case has one, whose
    masks (d) cannot draw, so (a) vs (d) is left out there.
    """
    case = runs.case
    if runs.f64 is None:
        for col in ("a_vs_d", "b_vs_d", "c_vs_d"):
            record(case, col, "n/a (bf16)")
        return
    init = initial_state(case)
    aliases = tied_aliases(case)
    cells = [("b_vs_d", runs.bundle_cpu, aliases), ("c_vs_d", runs.cpu, None)]
    if case.nodrop_recipe is None:
        cells.insert(0, ("a_vs_d", runs.xla, None))
    else:
        record(case, "a_vs_d", "n/a (dropout)")
    for col, run, al in cells:
        c = compare(run, runs.f64, case.cpu, col, al, init)
        record(case, col, c.summary())


def tied_aliases(case: Case) -> dict[str, str]:
    """Second names of tied tensors -> their primary names (named_state's aliases)."""
    from stepbundle.exporter.workspace import named_state

    r = case.recipe()
    return {a: s.name for s in named_state(r.model, r.optimizer) for a in s.aliases}


def report_text() -> str:
    """The table with a line on total time, or "" when no case ran."""
    if not ROWS:
        return ""
    order = list(CASES)
    rows = sorted(ROWS.values(), key=lambda r: order.index(r["case"]))
    total = sum(r["seconds"] for r in rows)
    return format_table(rows) + f"\nTraining all three ways, these cases took {total:.0f} s.\n"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table for the closing note."""
    lines = [
        "Worst relative differences, shown as metrics / state / updates. Metrics: every metric at "
        "every step, element by element (floor 1e-6). State: every parameter, buffer, "
        "optimizer-state and gradient tensor after the last step, normwise per tensor. "
        "Updates: for each parameter and buffer, ||(b) - ref|| / ||ref - initial value||, "
        "the share of its movement during training the runs disagree on. "
        "(a) torch_xla eagerly, (b) the bundle in a process without torch (newest jax), "
        "(c) PyTorch on the CPU (dropout disabled in both (b) and (c)). Tensors with a "
        "documented bound of their own (equiv_models.py) are listed after the semicolon.",
        "",
        "",
        '(b) against (a) is the bundle exported with `numerics="torch_xla"` (torch_xla\'s '
        "BatchNorm ops, what (a) computes); against (c) and (d) the default export "
        "(PyTorch's BatchNorm numerics). (d) is PyTorch on the CPU in float64, the ground "
        "truth: the last three columns say how near each run comes to it, under (c)'s "
        "bounds.",
        "",
        "| case | steps | (b) vs (a) | (b) vs (c) | (a) vs (d) | (b) vs (d) | (c) vs (d) "
        "| time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r.get(c, "not run") for c in ("b_vs_a", "b_vs_c", "a_vs_d", "b_vs_d", "c_vs_d")]
        lines.append(f"| {r['case']} | {r['steps']} | {' | '.join(cells)} | {r['seconds']:.0f} |")
    lines += ["", "Where the worst differences (under the default bounds) are:", ""]
    for r in rows:
        for col, label in (
            ("b_vs_a_where", "(b) vs (a)"),
            ("b_vs_c_where", "(b) vs (c)"),
            ("b_vs_d_where", "(b) vs (d)"),
        ):
            if col in r:
                lines.append(f"- {r['case']}, {label}: {r[col]}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------- test bodies


def initial_state(case: Case) -> dict[str, np.ndarray]:
    """The case's floating parameters and buffers before training, by primary name."""
    from support import to_numpy

    from stepbundle.exporter.workspace import named_state
    from stepbundle.schema.manifest import StateKind

    r = case.recipe()
    return {
        s.name: to_numpy(s.tensor).astype(np.float64)
        for s in named_state(r.model, r.optimizer)
        if s.kind in (StateKind.PARAMETER, StateKind.BUFFER) and s.tensor.is_floating_point()
    }


def initial_parameters(case: Case) -> dict[str, np.ndarray]:
    """The case's parameters before training, by their primary names."""
    from support import to_numpy

    from stepbundle.exporter.workspace import named_state
    from stepbundle.schema.manifest import StateKind

    r = case.recipe()
    return {
        s.name: to_numpy(s.tensor)
        for s in named_state(r.model, r.optimizer)
        if s.kind is StateKind.PARAMETER
    }


def assert_replays_torch_xla(runs: CaseRuns) -> Comparison:
    """(b) against (a), and proof that the comparison is not vacuous."""
    case = runs.case
    truth = runs.f64 if case.float64_arbiter is not None else None
    c = check_and_record(runs.bundle, runs.xla, case, "b_vs_a", truth)
    # Training moved every parameter, in both runs, so equal states mean equal updates.
    for name, init in initial_parameters(case).items():
        for label, run in (("torch_xla", runs.xla), ("bundle", runs.bundle)):
            assert normwise_rel(run.state[name], init) > 1e-7, f"{label} never moved {name}"
    if case.nodrop_recipe is not None:
        # Dropout really ran in the bundle: the same batch gives another loss without it.
        with_p = runs.bundle.series("loss")[0]
        without = runs.bundle_cpu.series("loss")[0]
        assert with_p != without, "dropout had no effect in the bundle"
    return c


def assert_matches_cpu(runs: CaseRuns) -> Comparison:
    """(b) against (c), both without dropout."""
    return check_and_record(runs.bundle_cpu, runs.cpu, runs.case, "b_vs_c")


def assert_matches_float64(runs: CaseRuns) -> Comparison:
    """(b), default numerics, against (d), PyTorch float64 on the CPU, under (c)'s bounds."""
    assert runs.f64 is not None, f"{runs.case.name} has no float64 run"
    return check_and_record(runs.bundle_cpu, runs.f64, runs.case, "b_vs_d")
