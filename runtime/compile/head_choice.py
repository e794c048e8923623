"""Reading a TPU-compiled train program: is the residual stream fused into the output head?

On a TPU, XLA sometimes fuses a transformer's whole residual stream into the product
that computes the output head's input gradient (``dlogits @ embedding``): the final
norm's backward and every layer's sum of the stream are recomputed inside the tiled
product, which then writes a dozen float32 activations (Hugging Face GPT-2 small
through the torch_xla front-end: one fusion with 17 results, 12 of them
``f32[8,1024,768]``, 15.1 of the 83.8 ms step on a v5e, where the hand-written JAX
model's counterpart takes 3.6 ms). Optimization barriers on the head products' narrow
values (``stablehlo/head_barriers.py``) keep the stream out of it; on programs where XLA
does not do this they cost time instead (docs/tpu.md has both). So ``compile_program``
compiles the program as it is, asks ``fused_stream`` of the compiled program, and only
where it answers compiles the barriered program too, keeping the one libtpu's own cost
model (``estimated_cycles``) prices lower.

Both functions read the optimized HLO's text (``executable.hlo_modules()``), which is
XLA's debug format: anything they cannot read makes them answer None, and the program
is kept as compiled. They read the entry computation only: a head inside a loop's body
(a steps-per-call program; a scanned model) is not looked for, and a steps-per-call
program follows its one-step program's choice. The load weighs a training program on one
device only: the estimate does not price collectives, so a layout over several devices
keeps its program as written (``head_barriers=True`` still puts the barriers in).

Imports: the standard library.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

__all__ = [
    "CALLS",
    "FusedStream",
    "MIN_SAME_SHAPE",
    "computations",
    "estimated_cycles",
    "fused_stream",
    "holds_product",
]

MIN_SAME_SHAPE = 4
"""The fewest results of one shape a product fusion must write to be read as a residual
stream fused into it (about one a layer: GPT-2 small's 12-layer program has 12; the
largest product fusions of the other programs measured write at most 2 of a shape,
docs/tpu.md). Finding one costs a second compile; the estimate decides."""

_FUSION = re.compile(r"\s*(?:ROOT )?%([\w.-]+) = \((.*)\) fusion\(.*?calls=%([\w.-]+)")
_SHAPE = re.compile(r"\b[a-z]+\d*\[[\d,]*\]")
_HEAD = re.compile(r"(ENTRY )?%?([\w.-]+) [(]")
CALLS = re.compile(r"(?:calls|to_apply)=%([\w.-]+)")
"""A line's called computations (a fusion's ``calls=``, a reduction's ``to_apply=``)."""
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


@dataclass(frozen=True)
class FusedStream:
    """A product fusion writing many results of one shape."""

    fusion: str  # its name in the optimized HLO
    results: int
    same_shape: int
    shape: str

    def describe(self) -> str:
        return (
            f"{self.fusion}, a product fusion writing {self.results} results, "
            f"{self.same_shape} of them {self.shape}"
        )


def computations(text: str) -> dict[str, list[str]]:
    """HLO text -> each computation's lines, by name ('ENTRY' for the entry computations of
    every module, together). A body ends at a line that is a lone '}' (a custom call's
    configuration spans lines of its own)."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = out.setdefault("ENTRY" if head.group(1) else head.group(2), [])
        elif line.rstrip() == "}":
            current = None
        elif current is not None:
            current.append(line)
    return out


def holds_product(comps: dict[str, list[str]], name: str, seen: set[str] | None = None) -> bool:
    """Whether computation ``name`` holds a matrix product (a convolution, XLA's form of
    one on a TPU, or a dot), directly or in a computation it calls."""
    seen = set() if seen is None else seen
    for line in comps.get(name, []):
        if " convolution(" in line or " dot(" in line:
            return True
        for callee in CALLS.findall(line):
            if callee not in seen:
                seen.add(callee)
                if holds_product(comps, callee, seen):
                    return True
    return False


def fused_stream(
    text: str, least: int = MIN_SAME_SHAPE, vocabularies: frozenset[int] | None = None
) -> FusedStream | None:
    """The entry computation's product fusion (one that holds a convolution, XLA's form
    of a matrix product on a TPU, or a dot) writing the most results of one shape, where
    that is at least ``least``; with ``vocabularies``, only a fusion that reads or writes a
    tensor with a dimension of one of those sizes (the output head's). None where there
    is none (or the text cannot be read)."""
    comps = computations(text)
    best: FusedStream | None = None
    for line in comps.get("ENTRY", []):
        m = _FUSION.match(line)
        if not m:
            continue
        shapes = _SHAPE.findall(m.group(2))
        if len(shapes) < least or not holds_product(comps, m.group(3)):
            continue
        if vocabularies is not None and not _touches(text, m.group(3), shapes, vocabularies):
            continue
        shape, same = Counter(shapes).most_common(1)[0]
        if same >= least and (best is None or same > best.same_shape):
            best = FusedStream(m.group(1), len(shapes), same, shape)
    return best


def _touches(text: str, called: str, results: list[str], vocabularies: frozenset[int]) -> bool:
    """Whether a fusion's results or its called computation's parameters (its operands)
    have a dimension of one of ``vocabularies``."""
    header = re.search(rf"^%{re.escape(called)} \((.*)\) -> ", text, re.M)
    shapes = results + (_SHAPE.findall(header.group(1)) if header else [])
    for shape in shapes:
        dims = shape[shape.index("[") + 1 : -1]
        if any(int(d) in vocabularies for d in dims.split(",") if d):
            return True
    return False


def estimated_cycles(text: str) -> int | None:
    """libtpu's estimate of the program's device time: the sum of ``estimated_cycles``
    over the entry computation's operations (the Pallas kernels and asynchronous copies
    carry none); None where no operation carries one (not a TPU's program)."""
    entry = "\n".join(computations(text).get("ENTRY", []))
    found = [int(c) for c in _CYCLES.findall(entry)]
    return sum(found) if found else None
