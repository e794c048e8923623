"""``--steps-per-call auto``: run K steps per dispatch when a step is dispatch-bound.

Every PJRT call costs the host a fixed amount of work, whatever the step computes:
about 0.58 ms on a TPU v5e's host, where the golden linear_adamw bundle took 0.59 ms a
step at one step per call and 0.032 ms at 32 (docs/tpu.md; benchmarks/results/device/
tpu-v5e/device_check.json). A step that short is almost all dispatch, and K steps per
call (``runtime/compile/multistep.py``, the same numbers bit for bit) remove it.

The rule, measured rather than guessed: load the bundle's training step once more at one
step per call, time ``PROBE_STEPS`` steps of a zero batch of its traced shape (after
``WARMUP_STEPS``), and take

    K = 32 when a step takes under 1 ms, 8 under 3 ms, else 1,

halved until it divides ``--checkpoint-every`` and ``--eval-every`` (the state is only
between calls there). The probe trains a throwaway copy of the state, never the run's;
it is skipped, and K is 1, when the state is over ``PROBE_MAX_STATE_BYTES`` (such a
model is not dispatch-bound, and a second copy could fill the device), for data
parallelism and ``--stop-on-nonfinite`` (which checks every step). ``run`` uses it when
``--steps-per-call`` is not given on an accelerator, and on any device with ``auto``;
the choice and its measurement are printed with the load line.

Imports: the runtime and schema (lazily), numpy.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["AutoSteps", "choose", "decide"]

WARMUP_STEPS = 3
PROBE_STEPS = 10
PROBE_MAX_STATE_BYTES = 256 << 20
THRESHOLDS_MS = ((1.0, 32), (3.0, 8))


@dataclass(frozen=True)
class AutoSteps:
    """What ``--steps-per-call auto`` chose and why (printed with the load line)."""

    steps_per_call: int
    step_ms: float | None
    reason: str

    def describe(self) -> str:
        measured = f"{self.step_ms:.3f} ms/step at 1 per call, " if self.step_ms is not None else ""
        return f"steps per call {self.steps_per_call} (auto: {measured}{self.reason})"


def choose(step_ms: float, cadences: tuple[int, ...] = ()) -> tuple[int, str]:
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
    from stepbundle.runtime.dtypes import to_numpy

    program = manifest.entries["train"].programs[0]
    return {b.name: np.zeros(b.spec.shape, to_numpy(b.spec.dtype)) for b in program.batch}


def decide(args: argparse.Namespace) -> AutoSteps | None:
    """Set ``args.steps_per_call`` to an int; return the automatic choice, if one was made."""
    given = getattr(args, "steps_per_call", 1)
    if isinstance(given, int):
        return None
    platform = args.device.partition(":")[0].lower()
    if args.entry != "train" or (given is None and platform == "cpu"):
        args.steps_per_call = 1
        return None
    args.steps_per_call = 1
    if args.stop_on_nonfinite:
        return AutoSteps(1, None, "--stop-on-nonfinite checks every step")
    if args.devices not in (1, "1"):
        return AutoSteps(1, None, "not measured with data parallelism")
    from stepbundle.runtime import CompileOptions, LoadOptions, SafetyOptions, load
    from stepbundle.runtime.io.store import resolve_bundle
    from stepbundle.schema import open_bundle

    from .init_from import state_options

    # A URL is fetched into the store here, once; the run's own load finds it there.
    digest = args.expect_digest or getattr(args, "bundle_digest", None)
    path = resolve_bundle(getattr(args, "bundle_file", None) or args.bundle, expect_digest=digest)
    with open_bundle(path) as b:
        state_bytes = sum(s.spec.nbytes for s in b.manifest.state)
    if state_bytes > PROBE_MAX_STATE_BYTES:
        return AutoSteps(1, None, f"{state_bytes >> 20} MiB of state is not dispatch-bound")
    options = LoadOptions(
        compile=CompileOptions(
            entries=("train",),
            cache_dir=False if args.no_cache else (args.cache_dir or True),
            steps_per_call=1,
            matmul_precision=args.matmul_precision,
            fused_attention=not args.no_fused_attention,
        ),
        state=state_options(args),
        # The probe compiles and runs the bundle: it is held to the digest as the run is.
        safety=SafetyOptions(expect_digest=digest),
    )
    probe = load(path, args.device, options=options)
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
    k, reason = choose(step_ms, (args.checkpoint_every or 0, args.eval_every or 0))
    args.steps_per_call = k
    return AutoSteps(k, step_ms, reason)
