"""Interleaved, repeated timing: medians that a noisy 2-core machine cannot skew much.

Each method is warmed up, then given a block size ``k`` (steps per timed block) so a
block lasts about ``target_s``. Then ``rounds`` rounds run; each round times one block of
every method, in an order that rotates from round to round, so slow phases of the
machine (another process, a frequency change) hit every method alike. A method's figure
is the median over rounds of (block seconds / k).

Each block's CPU time (``time.process_time``: every thread of this process, not the time
other processes held the cores) is recorded too: on a shared machine it is much less
noisy than wall time, and it is what a method costs the process, whoever else runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from methods import Method


@dataclass
class Timing:
    method: str
    steps_per_block: int
    samples_ms: list[float] = field(default_factory=list)
    cpu_samples_ms: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def cpu_median_ms(self) -> float:
        return statistics.median(self.cpu_samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    def quantile_ms(self, q: float) -> float:
        xs = sorted(self.samples_ms)
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def warm_up(method: Method, warmup_s: float, min_steps: int = 3) -> float:
    """Run ``method`` for about ``warmup_s`` (at least ``min_steps``); return s per step."""
    method.block(min_steps)
    per_step = []
    spent = 0.0
    k = 1
    while spent < warmup_s or len(per_step) < 3:
        dt = method.block(k)
        spent += dt
        per_step.append(dt / k)
        k = min(k * 2, 256)
    return statistics.median(per_step[-3:])


def _block_size(method: Method, steps: float, max_k: int) -> int:
    """About ``steps`` steps, at most ``max_k``, and a whole number of the method's
    ``granularity`` (K for K steps per call), so that a timed block runs exactly the
    steps its time and CPU time are divided by."""
    g = int(getattr(method, "granularity", 1))
    k = max(1, min(max_k, round(steps)))
    return max(g, -(-k // g) * g)


def measure(
    methods: Sequence[Method],
    *,
    rounds: int,
    target_s: float,
    warmup_s: float,
    max_k: int = 500,
) -> dict[str, Timing]:
    estimates = {m.name: warm_up(m, warmup_s) for m in methods}
    out = {
        m.name: Timing(m.name, _block_size(m, target_s / estimates[m.name], max_k)) for m in methods
    }
    n = len(methods)
    for r in range(rounds):
        for j in range(n):
            m = methods[(r + j) % n]
            t = out[m.name]
            c0 = time.process_time()
            wall = m.block(t.steps_per_block)
            cpu = time.process_time() - c0
            t.samples_ms.append(1e3 * wall / t.steps_per_block)
            t.cpu_samples_ms.append(1e3 * cpu / t.steps_per_block)
    return out


def now() -> float:
    return time.perf_counter()
