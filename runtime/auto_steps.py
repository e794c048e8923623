"""``steps_per_call="auto"``: run K steps per dispatch when a step is dispatch-bound.

Every PJRT call costs the host a fixed amount of work, whatever the step computes (a
TPU v5e's host: docs/tpu.md). A step that short is almost all dispatch, and K steps per
call (``runtime/compile/multistep.py``, the same numbers bit for bit) remove it.

The rule, measured rather than guessed: load the bundle's training step once more at one
step per call, time ``PROBE_STEPS`` steps of a zero batch of its traced shape (after
``WARMUP_STEPS``), and take

    K = 32 when a step takes under 1 ms, 8 under 3 ms, else 1,

halved until it divides every cadence the caller names (``CompileOptions.cadences``;
``stepbundle run`` passes ``--checkpoint-every`` and ``--eval-every``: the state is only
between calls there). The
probe trains a throwaway copy of the state, never the caller's; it is skipped, and K is
1, when the state is over ``PROBE_MAX_STATE_BYTES`` (such a model is not dispatch-bound,
and a second copy could fill the device), for data parallelism and with
``stop_on_nonfinite`` (which checks every step).

``load(path, device, LoadOptions(compile=CompileOptions(steps_per_call="auto")))`` probes
here and records the choice in ``LoadInfo.auto_steps``, for a Python caller and for
``stepbundle run`` alike (which passes "auto" and its cadences, and prints that line
beside its load line). The probe is a load: ``load`` is handed in (by ``load`` itself),
so that this module and ``load.py`` do not import each other.

Imports: the runtime's options, store and dtypes, the schema, numpy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .options import LoadOptions, ParallelOptions, SafetyOptions

__all__ = ["AutoSteps", "choose", "probe_steps_per_call", "resolve_auto_steps"]

WARMUP_STEPS = 3
PROBE_STEPS = 10
PROBE_MAX_STATE_BYTES = 256 << 20
THRESHOLDS_MS = ((1.0, 32), (3.0, 8))


@dataclass(frozen=True)
class AutoSteps:
    """What ``steps_per_call="auto"`` chose and why.

    Attributes:
      steps_per_call: the K chosen.
      step_ms: the measured time of one step at one step per call; None when nothing
        was measured (``reason`` says why).
      reason: why this K, in words.
    """

    steps_per_call: int
    step_ms: float | None
    reason: str

    def describe(self) -> str:
        """``steps per call 32 (auto: 0.200 ms/step at 1 per call, dispatch-bound)``."""
        measured = f"{self.step_ms:.3f} ms/step at 1 per call, " if self.step_ms is not None else ""
        return f"steps per call {self.steps_per_call} (auto: {measured}{self.reason})"


def choose(step_ms: float, cadences: Sequence[int] = ()) -> tuple[int, str]:
    """K for a step measured at ``step_ms`` per step, dividing every non-zero cadence."""
    k = 1
    for limit, steps in THRESHOLDS_MS:
        if step_ms < limit:
            k = steps
            break
    if k == 1:
        return 1, "not dispatch-bound"
    wanted = k
    while k > 1 and any(c and c % k for c in cadences):
        k //= 2
    if k == 1:
        return 1, "dispatch-bound, but no K > 1 divides the checkpoint/eval cadence"
    if k < wanted:
        return k, f"dispatch-bound; {wanted} lowered to {k} to divide the checkpoint/eval cadence"
    return k, "dispatch-bound"


def _zero_batch(manifest: Any) -> dict[str, np.ndarray[Any, Any]]:
    from .dtypes import to_numpy

    program = manifest.entries["train"].programs[0]
    return {b.name: np.zeros(b.spec.shape, to_numpy(b.spec.dtype)) for b in program.batch}


Load = Callable[..., Any]
"""``stepbundle.runtime.load``: ``load(path, device, options=...)`` returning a Trainer."""


def probe_steps_per_call(
    load: Load, bundle: Any, device: str, options: LoadOptions, *, cadences: Sequence[int] = ()
) -> AutoSteps:
    """Measure ``bundle``'s training step at one step per call and choose K (``choose``),
    loading it with ``load`` (``stepbundle.runtime.load``).

    ``options`` are the load's own (its state, compile cache, precision and expected
    digest serve the probe too); ``cadences`` are step counts K must divide. A URL is
    fetched into the bundle store here, once; the load that follows finds it there.

    Raises:
      BundleError, CheckpointError, DeviceError: the probe's load or steps failed, as
        the load itself would have.
    """
    from stepbundle.schema import open_bundle

    from .io.store import resolve_bundle

    if options.safety.stop_on_nonfinite:
        return AutoSteps(1, None, "--stop-on-nonfinite checks every step")
    if options.parallel.devices not in (1, "1"):
        return AutoSteps(1, None, "not measured with data parallelism")
    digest = options.safety.expect_digest
    path = resolve_bundle(bundle, expect_digest=digest)
    with open_bundle(path) as b:
        state_bytes = sum(s.spec.nbytes for s in b.manifest.state)
    if state_bytes > PROBE_MAX_STATE_BYTES:
        return AutoSteps(1, None, f"{state_bytes >> 20} MiB of state is not dispatch-bound")
    probe_options = dataclasses.replace(
        options,
        compile=dataclasses.replace(
            options.compile, entries=("train",), steps_per_call=1, compile_only=False
        ),
        # The probe compiles and runs the bundle: it is held to the digest as the run is.
        safety=SafetyOptions(expect_digest=digest),
        parallel=ParallelOptions(),
    )
    probe = load(path, device, options=probe_options)
    batch = _zero_batch(probe.manifest)
    for _ in range(WARMUP_STEPS):
        probe.step(batch)
    probe.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(PROBE_STEPS):
        probe.step(batch)
    probe.block_until_ready()
    step_ms = (time.perf_counter() - t0) / PROBE_STEPS * 1e3
    del probe
    k, reason = choose(step_ms, cadences)
    return AutoSteps(k, step_ms, reason)


def resolve_auto_steps(
    load: Load, bundle: Any, device: str, options: LoadOptions
) -> tuple[LoadOptions, AutoSteps | None]:
    """``options`` with ``steps_per_call="auto"`` replaced by the K measured for it
    (``probe_steps_per_call``, kept to ``options.compile.cadences``), and what was
    chosen; ``options`` as they are, and None, for any other ``steps_per_call``."""
    if options.compile.steps_per_call != "auto":
        return options, None
    wanted = options.compile.entries
    if options.compile.compile_only:
        # compile_only reads and places no state, so nothing can run to be measured
        auto = AutoSteps(1, None, "compile_only runs no step to measure")
    elif wanted is not None and "train" not in wanted:
        auto = AutoSteps(1, None, "the train entry is not loaded")
    else:
        auto = probe_steps_per_call(
            load, bundle, device, options, cadences=options.compile.cadences
        )
    k = auto.steps_per_call
    return dataclasses.replace(
        options, compile=dataclasses.replace(options.compile, steps_per_call=k)
    ), auto
