"""The export check: the bundle's first step against one eager PyTorch step, by default.

After a front-end writes a bundle, ``check_bundle`` runs the bundle's training step once
on the CPU through the runtime, from the bundle's initial state (a bundle without
weights: the model's own parameters and buffers, handed to the runtime as its
``init_from``) with the recipe's example batch, and runs
the recipe's own step once, eagerly, on a deep copy of the model and optimizer starting
from the same state. Every metric and every state tensor must agree within what float32
rounding explains (``Bounds``; for a bf16/f16 or autocast step, bf16 rounding of the value
and an update that float64 finds as close as eager's); otherwise ``CheckFailed`` names
the metric or tensor that differs most, with both values.

Where it runs:

- The runtime runs in a child process (``step_runtime.py``), ``python -m stepbundle.cli.step_check``: the
  front-ends may not import the runtime (``tests/test_layering.py``), and the runtime
  needs jax's 64-bit mode. In the child, the program's CPU compile and its one step are
  most of the check's cost; its start (mostly jax's import) runs while the export does
  (the front-ends start it before they trace: ``runtime_ahead``); the eager step runs
  beside its compile and step, on half the cores. The child compiles the train program as ``stepbundle
  run`` does on the CPU and leaves the executable in the compile cache
  (``STEPBUNDLE_CACHE_DIR``): a run of the bundle on this machine does not compile it
  again.
- The eager reference is ``CPU_EAGER`` (PyTorch on the CPU), unless the front-end passes
  another: the torch_xla front-end steps torch_xla eagerly where only it computes what
  the bundle computes (random numbers drawn by XLA's generator; ``numerics="torch_xla"``).
  A capturable optimizer runs eagerly on the CPU with ``capturable=False``: torch refuses
  a capturable step on the CPU, and both settings compute the same update (torch's
  documentation; the capturable one keeps the step count a tensor).
- A step that draws random numbers is compared against an eager step that draws the same
  ones (torch_xla eager from the bundle's seed; for the torch front-end, whose program
  draws from jax's threefry, PyTorch on the CPU with the program's draws replayed:
  ``stepbundle.export_torch.check``). Where the reference finds it cannot draw the same
  (``CannotReproduce``), or the front-end has none, the check is skipped and the report
  says why.
- Before any number is compared, both sides must hold the same state: the same tensors
  under the same names, in the same dtypes and shapes (``_unmatched``; a gradient the step
  rebuilds, or state neither step made, is left out, and the export line says so).
  Each state tensor is then judged whole and row by row (``step_compare``).
- Where float32's bounds and the float64 arbiter would still refuse the bundle, a ReLU
  input within float32's rounding of zero that the bundle's step decided the other way
  from PyTorch may explain it: float64 decided that way must then match every metric
  and state tensor (``step_ties``), and the export line says which input it was.

Imports: torch, safetensors, stepbundle.schema (the runtime only as a child process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from stepbundle.schema.manifest import (
    InputKind,
    Manifest,
    MetricOutput,
    Program,
    StateKind,
    StateUpdateOutput,
)

from .errors import ExportError
from .progress import counted
from .recipe import Recipe
from .step_compare import (
    FLOAT32,
    LOW_PRECISION,
    Bounds,
    Verdict,
    describe,
    suspects,
    update_verdicts,
)
from .step_compare import verdicts as judge
from .step_eager import (
    CPU_EAGER,
    CannotReproduce,
    CheckCouldNotRun,
    Reference,
    _copies,
    _eager,
    _float64_for,
    _Lazy,
    _to_float64,
    state_by_name,
)
from .step_runtime import RuntimeStep, children_cpu_time, cpu_time, scratch_dir
from .step_ties import arbitrate

__all__ = [
    "CPU_EAGER",
    "RuntimeStep",
    "Bounds",
    "CannotReproduce",
    "CheckCouldNotRun",
    "CheckFailed",
    "CheckReport",
    "Reference",
    "UNCHECKED",
    "check_bundle",
    "check_wanted",
    "runtime_ahead",
    "state_by_name",
]

CHECK_ENV = "STEPBUNDLE_EXPORT_CHECK"
"""``STEPBUNDLE_EXPORT_CHECK=0`` turns the check's default off (a machine whose models
are all too big to step on its CPU; the project's test suite, whose tests of other
things export hundreds of bundles). ``check=True`` or ``False`` given to ``export`` wins."""


def check_wanted(check: bool | None) -> bool:
    """``export``'s ``check`` argument resolved: as given, else on unless
    ``STEPBUNDLE_EXPORT_CHECK`` is ``0``, ``false``, ``no`` or ``off``."""
    if check is not None:
        return bool(check)
    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def runtime_ahead(wanted: bool) -> Iterator[RuntimeStep | None]:
    """The check's runtime process, started now (``wanted``; else None) for an export that
    will check: it starts Python and imports the runtime while the export traces and
    writes, then waits for ``check_bundle(..., runtime=...)`` to hand it the bundle. It is
    ended on the way out, whatever happened (an export that failed, a check skipped).

    Its start costs the same processor time either way, and no longer adds to the check's
    wall time (GPT-2 small's: benchmarks/results/export_check.md)."""
    runtime = RuntimeStep() if wanted else None
    try:
        yield runtime
    finally:
        if runtime is not None:
            runtime.stop()


class CheckFailed(ExportError):
    """The bundle's step and the eager step disagree beyond what rounding explains
    (float32's, or for a low-precision step its update against PyTorch float64's).

    Attributes:
      name: the metric or state tensor that differs most (against its bound).
      bundle_value, eager_value: its values there (the element that differs most).
    """

    def __init__(self, message: str, name: str, bundle_value: float, eager_value: float):
        super().__init__(message)
        self.name = name
        self.bundle_value = bundle_value
        self.eager_value = eager_value


@dataclass(frozen=True)
class CheckReport:
    """What the check did, for the export line (``ExportReport.check``).

    Attributes:
      ran: False when it was skipped; ``reason`` says why.
      reference: the eager step compared against.
      seconds: its wall time (the runtime's process and the eager step overlap).
      runtime_seconds: the runtime process from the bundle handed to it (what of its
        start the export did not hide, compile, step, write).
      eager_seconds: the eager step (and the float64 one, when it ran).
      cpu_seconds: processor time of this process and the runtime's over the check (on a
        busy machine a fairer measure of its cost than wall time); the runtime's start
        counts here, though it ran during the export.
      runtime_cpu_seconds: the runtime process's processor time (its start included).
      eager_cpu_seconds: this process's processor time over the eager step(s).
      runtime_parts: the runtime process's wall seconds by part, as it measured them
        (``load.open``, ``load.compile``, ``load.state``, ``step``, ``write``; the rest of
        ``runtime_seconds`` is what of its start and imports the export did not hide;
        ``wait``: how long it had waited for the bundle), and its processor seconds
        (``cpu.start``, ``cpu.load``, ``cpu.step``, ``cpu.write``).
      compared: metrics and state tensors compared.
      closest: the one nearest its bound, and how near (a fraction of the bound).
      uncompared: state on one side only that the binding table explains, in words
        (``_unmatched``; "" when none): gradients the step rebuilds, state neither step
        made.
      reason: why it was skipped.
      ties: where the bundle passed because float64 with a ReLU input decided the other
        way matches it (``step_ties``), which input, in words ("" otherwise).
      ties_cpu_seconds: the tie arbitration's processor time (0 where nothing failed;
        counted in ``eager_cpu_seconds`` too).
    """

    ran: bool
    reference: str = ""
    seconds: float = 0.0
    runtime_seconds: float = 0.0
    eager_seconds: float = 0.0
    cpu_seconds: float = 0.0
    runtime_cpu_seconds: float = 0.0
    eager_cpu_seconds: float = 0.0
    runtime_parts: Mapping[str, float] = dataclasses.field(default_factory=dict)
    compared: int = 0
    closest: str = ""
    uncompared: str = ""
    reason: str = ""
    ties: str = ""
    ties_cpu_seconds: float = 0.0

    def line(self) -> str:
        """The export line."""
        if not self.ran:
            return f"check skipped: {self.reason}"
        uncompared = (
            f"; not compared, as the binding table explains: {self.uncompared}"
            if self.uncompared
            else ""
        )
        return (
            f"checked: one step through the runtime on the CPU against {self.reference}: "
            f"{self.compared} metrics and state tensors agree (closest to its bound: "
            f"{self.closest}){uncompared}{f'; {self.ties}' if self.ties else ''}; "
            f"{self.seconds:.1f}s (runtime process "
            f"{self.runtime_seconds:.1f}s, eager {self.eager_seconds:.1f}s; "
            f"{self.cpu_seconds:.1f}s of processor time)"
        )


_UNCHECKED_ADVICE = (
    "check=False (stepbundle export --no-check) would write this bundle anyway, known to "
    "differ from eager: it is meant for models too big to step on the CPU, not for this"
)

UNCHECKED = (
    "written unchecked (check=False, --no-check or STEPBUNDLE_EXPORT_CHECK=0): nothing "
    "compared the bundle's step with the recipe's eager step"
)
"""The export line of an export with the check turned off."""


def _unmatched(
    manifest: Manifest,
    program: Program,
    after: Mapping[str, torch.Tensor],
    eager: Mapping[str, torch.Tensor],
    before: Mapping[str, torch.Tensor],
) -> tuple[list[Verdict], str]:
    """State tensors on one side only: refusals (``Verdict.structural``), and what is
    left uncompared because the binding table explains it, in words ("" if nothing).

    Explained: a gradient eager holds that the bundle keeps no state for (the step
    throws it away and rebuilds it: ``zero_grad()`` at its start), and a state tensor the
    bundle holds, the train program does not write, and eager's step does not have where
    it never made it or it is a gradient (the fresh optimizer state of a parameter no
    gradient reached; a gradient the step set to None). Anything else on one side only
    is refused: a tensor the runtime did not return, one the program writes and eager
    has not, one eager has and the bundle's state table does not list."""
    written = {o.state for o in program.outputs if isinstance(o, StateUpdateOutput)}
    known = {n for e in manifest.state for n in (e.name, *e.aliases)}
    params = {n for e in manifest.state if e.kind is StateKind.PARAMETER
              for n in (e.name, *e.aliases)}  # fmt: skip
    out: list[Verdict] = []
    neither = rebuilt = 0

    def refuse(name: str, why: str) -> None:
        out.append(Verdict(name, math.inf, "", math.nan, math.nan, why, structural=True))

    for e in manifest.state:
        if e.name not in after:
            refuse(e.name, "the bundle's state table lists it, and the runtime's step "
                   "returned no value for it")  # fmt: skip
        elif e.name not in eager:
            if e.name in written:
                refuse(e.name, "the bundle's step writes it, and eager's step ends without it")
            elif e.kind is StateKind.GRADIENT or e.name not in before:
                neither += 1
            else:
                refuse(e.name, "the bundle holds it, and eager's step ended without it "
                       "(it was there before the step)")  # fmt: skip
    for name in eager:
        if name in known:
            continue
        if name.endswith(".grad") and name[: -len(".grad")] in params:
            rebuilt += 1
        else:
            refuse(name, "eager's step ends with it, and the bundle's state table does not "
                   "list it")  # fmt: skip
    said = []
    if rebuilt:
        said.append(f"{counted(rebuilt, 'gradient')} the step rebuilds every step (the "
                    "bundle keeps no state for them)")  # fmt: skip
    if neither:
        said.append(f"{counted(neither, 'state tensor')} the bundle holds unchanged and "
                    "eager's step never made or set to None")  # fmt: skip
    return out, "; ".join(said)


def _refuse(path: Path, v: Verdict, reference: str) -> None:
    """Remove the bundle and raise ``CheckFailed`` for ``v``, a structural difference."""
    with contextlib.suppress(OSError):
        path.unlink()
    raise CheckFailed(
        f"The exported step does not compute what the recipe's step computes: after one "
        f"step from the same state and batch, state tensor {v.name!r}: {v.detail}; no "
        f"rounding explains that. Compared against {reference}. The bundle at "
        f"{os.fspath(path)!r} was removed. This is a bug of stepbundle or an unsupported "
        f"pattern in the step: please report it with the recipe. {_UNCHECKED_ADVICE}.",
        v.name,
        v.bundle,
        v.eager,
    )


def _low_precision(manifest: Manifest, autocast: bool) -> bool:
    low = {"bfloat16", "float16", "bf16", "f16"}
    specs = [s.spec for s in manifest.state]
    specs += [n.spec for p in manifest.entries["train"].programs for n in p.batch]
    return autocast or any(str(getattr(s.dtype, "value", s.dtype)) in low for s in specs)


def check_bundle(
    recipe: Recipe,
    path: str | os.PathLike[str],
    manifest: Manifest,
    *,
    reference: Reference = CPU_EAGER,
    random_reference: Reference | str,
    say: Callable[[str], None] = lambda _m: None,
    runtime: RuntimeStep | None = None,
    ties: bool = True,
) -> CheckReport:
    """Step the bundle at ``path`` once through the runtime and ``recipe`` once eagerly;
    compare every metric and state tensor.

    Where a tensor is further from the eager step than ``Bounds`` allow, and the
    reference is PyTorch on the CPU, the step is run once more in float64 (for the failing
    parameters alone where that computes the same for them: ``_float64_for``): the bundle
    passes where it is no further from float64 than twice PyTorch float32's own distance
    (rounding that the step itself amplifies, such as Adam dividing a gradient that is
    zero in exact arithmetic by its own magnitude, moves PyTorch float32 as much).

    Where that still refuses it under float32 bounds, a ReLU tie may explain it: one ReLU
    input within float32's rounding of zero that the bundle's step decided the other way
    from PyTorch's (``step_ties``). The bundle passes where float64 with that input (or
    two such) decided the other way matches every metric and state tensor as closely as
    float64 is asked to above, and the export line says which input it was.

    Under low-precision bounds (``Bounds.suspect``: bf16/f16 or autocast steps,
    numerics='torch_xla') a state tensor beyond them, and one within them whose update is
    further than ``suspect`` of its size from eager's, is judged by its update against the
    float64 step's (``step_compare.update_verdicts``), where the reference has a float64
    step (``Reference.float64``; its ``float64_run`` where that is not ``run``); a metric
    beyond them fails as it is.

    Args:
      recipe: the recipe exported (its model and optimizer are deep-copied, never
        stepped; torch's RNG state is left as it was).
      path, manifest: the bundle written and its manifest.
      reference: the eager step for a program that draws no random numbers.
      random_reference: the eager step for one that does (it must draw the same numbers
        from the bundle's seed), or why none can (the check is then skipped, saying so).
      say: progress lines.
      runtime: the runtime's process, started ahead (``runtime_ahead``); None: started
        here.
      ties: where the check would refuse under float32 bounds, look for a ReLU input that
        float32 rounding decides either way and float64 decided the bundle's way matches
        (``step_ties.arbitrate``); False: refuse as it stands.

    Raises:
      CheckFailed: a metric or state tensor differs beyond ``Bounds``; the bundle at
        ``path`` is removed.
      CheckCouldNotRun: the runtime's process failed, or the eager step raised.
    """
    t0 = time.perf_counter()
    cpu0 = cpu_time()
    program = manifest.entries["train"].programs[0]
    draws = any(i.kind is InputKind.RNG_SEED for i in program.inputs)
    if draws and isinstance(random_reference, str):
        if runtime is not None:
            runtime.stop()
        return CheckReport(False, reason=random_reference)
    ref = random_reference if draws and isinstance(random_reference, Reference) else reference
    seed = manifest.rng.seed if draws and manifest.rng is not None else None
    path = Path(path)
    batch = dict(recipe.example_batch)
    with tempfile.TemporaryDirectory(prefix="stepbundle-check-", dir=scratch_dir(manifest)) as tmp:
        work = Path(tmp)
        init: dict[str, torch.Tensor] = {}
        if not recipe.include_state:  # the runtime takes the weights from the model's
            held = state_by_name(recipe.model, recipe.optimizer)
            kinds = (StateKind.PARAMETER, StateKind.BUFFER)
            init = {
                e.name: held[e.name] for e in manifest.state if e.kind in kinds and e.name in held
            }
        if runtime is None:
            runtime = RuntimeStep()
        try:
            runtime.begin(path, batch, work, init)
        except BaseException:
            runtime.stop()
            raise
        try:
            t_eager, cpu_eager = time.perf_counter(), time.process_time()
            # The state before the step: the user's own tensors, which nothing changes.
            before = state_by_name(recipe.model, recipe.optimizer, copy=False)
            model, opt = _copies(recipe)
            eager_metrics, eager_state, autocast = _eager(ref, recipe, model, opt, batch, seed)
            eager_seconds = time.perf_counter() - t_eager
            eager_cpu = time.process_time() - cpu_eager
        except CannotReproduce as e:  # its draws are not the bundle's: nothing to compare
            runtime.stop()
            return CheckReport(False, reference=ref.name, reason=f"{ref.name} cannot "
                               f"reproduce the bundle's random numbers: {e}")  # fmt: skip
        except BaseException:
            runtime.stop()
            raise
        runtime_cpu = children_cpu_time()
        runtime_seconds = runtime.wait()
        runtime_cpu = children_cpu_time() - runtime_cpu
        parts = json.loads((work / "seconds.json").read_text())
        from safetensors import safe_open

        after_file = safe_open(str(work / "after.safetensors"), framework="pt")
        after = _Lazy(after_file)
        metrics = json.loads((work / "metrics.json").read_text())
        del model, opt
        bounds = ref.bounds or (LOW_PRECISION if _low_precision(manifest, autocast) else FLOAT32)
        metric_names = [
            o.name
            for o in program.outputs
            if isinstance(o, MetricOutput) and o.name in metrics and o.name in eager_metrics
        ]
        unmatched, uncompared = _unmatched(manifest, program, after, eager_state, before)
        state_names = [e.name for e in manifest.state if e.name in after and e.name in eager_state]
        bundle = (metrics, after)
        found = unmatched + judge(
            metric_names, state_names, bundle, (eager_metrics, eager_state), before, bounds
        )
        # Another dtype or shape, or a tensor on one side only: no rounding explains it,
        # and no float64 step is asked.
        structural = [v for v in found if v.structural]
        if structural:
            _refuse(path, structural[0], ref.name)
        failing = {v.name for v in found if v.ratio > 1.0}
        # The tensors beyond the bound, and the suspect ones within it (a row's update
        # further than half its size from eager's; under low-precision bounds also the
        # whole update), judged by their update against float64's. Under low-precision
        # bounds a failing metric fails as it is.
        if bounds.suspect is None:
            ask = failing | suspects(found, bounds)
        else:
            ask = set() if failing & set(metric_names) else failing | suspects(found, bounds)
        arbitrated = 0
        unarbitrated = 0
        replayed = False
        arbiter = ref
        if ask and not ref.float64:
            unarbitrated = len(ask - failing)
        elif ask:
            arbiter = (
                ref if ref.float64_run is None else dataclasses.replace(ref, run=ref.float64_run)
            )
            # Only the asked tensors of the float32 step are needed from here on: the
            # rest is let go before the float64 copy is made (GPT-2 small's float32 state is gigabytes).
            eager_state = {k: v for k, v in eager_state.items() if k in ask}
            t64, cpu64 = time.perf_counter(), time.process_time()
            replayed = True
            try:
                found64 = (
                    _float64_for(recipe, ask, metric_names, eager_state, arbiter, batch, seed)
                    if arbiter is ref  # its pruned float32 step must match eager's bit for bit
                    else None
                )
                if found64 is None:  # every parameter's gradient, every update: the whole step
                    model, opt = _copies(recipe)
                    batch64 = _to_float64(model, opt, batch)
                    m64, s64, _ = _eager(arbiter, recipe, model, opt, batch64, seed)
                    del model, opt
                else:
                    m64, s64 = found64
            except CannotReproduce:
                # the float64 step's random draws did not line up with the bundle's (the
                # float32 step's did): the asked tensors are judged by the bounds alone
                replayed = False
            eager_seconds += time.perf_counter() - t64
            eager_cpu += time.process_time() - cpu64
            kept = []
            if not replayed:
                unarbitrated = len(ask - failing)
                kept = list(found)
            elif bounds.suspect is None:
                # The tensors beyond their bound: PyTorch float32's own distance decides.
                fm = [n for n in metric_names if n in failing]
                fs = [n for n in state_names if n in failing]
                # The suspect ones within it: their updates (and their rows') against
                # float64's.
                judged = update_verdicts(ask - failing, after, eager_state, s64, before, bounds)
                unarbitrated = len(ask - failing - set(judged))
                e32 = {v.name: v for v in judge(fm, fs, (
                    {k: {"values": torch.as_tensor(v).double().reshape(-1).tolist()}
                     for k, v in eager_metrics.items() if k in fm}, eager_state),
                    (m64, s64), before, bounds, dtypes=False)}  # fmt: skip
                b64 = {v.name: v for v in judge(fm, fs, bundle, (m64, s64), before, bounds,
                                                dtypes=False)}  # fmt: skip
                for v in found:
                    if v.name in judged:
                        v = judged[v.name]
                        arbitrated += v.ratio <= 1.0
                    elif v.name in failing:
                        v64 = b64[v.name]
                        own = e32[v.name].ratio  # PyTorch float32's own distance, in bounds
                        if v64.ratio <= max(1.0, 2.0 * own):
                            arbitrated += 1
                            v = dataclasses.replace(v, ratio=v64.ratio / max(1.0, 2.0 * own))
                    kept.append(v)
            else:
                judged = update_verdicts(ask, after, eager_state, s64, before, bounds)
                unarbitrated = len(ask - failing - set(judged))
                for v in found:
                    if v.name in judged:
                        v = judged[v.name]
                        arbitrated += v.ratio <= 1.0
                    kept.append(v)
            found = kept
        tie = None
        if ties and replayed and bounds.suspect is None and max(v.ratio for v in found) > 1.0:
            # Refused as it stands: a ReLU input float32 rounding decides either way may
            # explain it (step_ties).
            tie = arbitrate(recipe, ref, arbiter, batch, seed, bundle, metric_names,
                            state_names, {v.name for v in found if v.ratio > 1.0}, before,
                            bounds)  # fmt: skip
            eager_seconds += tie.seconds
            eager_cpu += tie.cpu_seconds
            if tie.flipped:
                found = tie.verdicts
    seconds = time.perf_counter() - t0
    if not found:  # pragma: no cover - every train program has a loss metric
        return CheckReport(False, reason="nothing to compare")
    worst = max(found, key=lambda v: v.ratio)
    if worst.ratio > 1.0:
        with contextlib.suppress(OSError):
            path.unlink()
        no_tie = f" No ReLU tie explains it: {tie.reason}." if tie and tie.candidates else ""
        raise CheckFailed(
            f"The exported step does not compute what the recipe's step computes: after one "
            f"step from the same state and batch, {describe(worst)} ({worst.detail}; "
            f"{worst.ratio:.3g}x {worst.against or f'the bound {bounds.label} explains'}). "
            f"Compared against {ref.name}.{no_tie} The bundle at {os.fspath(path)!r} was "
            f"removed. This is a bug of stepbundle or an unsupported pattern in the step: "
            f"please report it with the recipe. {_UNCHECKED_ADVICE}.",
            worst.name,
            worst.bundle,
            worst.eager,
        )
    report = CheckReport(
        True,
        reference=ref.name,
        seconds=seconds,
        runtime_seconds=runtime_seconds,
        eager_seconds=eager_seconds,
        cpu_seconds=cpu_time() - cpu0,
        runtime_cpu_seconds=runtime_cpu,
        eager_cpu_seconds=eager_cpu,
        runtime_parts={k: float(v) for k, v in parts.items()},
        compared=len(found),
        uncompared=uncompared,
        ties=tie.words() if tie is not None and tie.flipped else "",
        ties_cpu_seconds=tie.cpu_seconds if tie is not None else 0.0,
        closest=f"{worst.name} at {worst.ratio:.2g} of it"
        + (
            " against float64 with the tie decided the bundle's way"
            if tie is not None and tie.flipped
            else f"; {arbitrated} within "
            f"{'PyTorch float32' if bounds.suspect is None else 'eager'}'s own distance from "
            f"float64"
            if arbitrated
            else ""
        )
        + (
            f"; {unarbitrated} updates further from eager's than rounding alone suggests, "
            f"and no float64 step to decide (random numbers)"
            if unarbitrated
            else ""
        ),
    )
    say(report.line())
    return report
