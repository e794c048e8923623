"""``stepbundle inspect``'s default view: what a bundle is, in one screen.

Who made it and from what (metadata, producer), what a step takes and gives (each
entry's batch signature and metrics), what can be set (hyperparameters and their
values, the RNG seed), what was frozen into it (constants with their values), and how
big it is (parameter count, state and program sizes). ``--full`` prints every binding,
output and section instead.

Imports: the standard library, stepbundle.schema (no jax, no torch, no numpy).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

from stepbundle.schema.manifest import (
    ConstantInput,
    DType,
    Manifest,
    MetricOutput,
    SectionKind,
    StateKind,
    TensorSpec,
)

__all__ = ["modes_text", "nbytes", "summary_lines"]

# Constants with at most this many elements are shown with their values.
_SHOWN_ELEMENTS = 8
# Metadata keys shown first, in this order; the rest follow sorted.
_FIRST_KEYS = ("name", "description", "source_commit")

_STRUCT = {
    DType.F64: "d", DType.F32: "f", DType.F16: "e", DType.I64: "q", DType.I32: "i",
    DType.I16: "h", DType.I8: "b", DType.U64: "Q", DType.U32: "I", DType.U16: "H",
    DType.U8: "B", DType.BOOL: "?",
}  # fmt: skip


def nbytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _values(spec: TensorSpec, data: bytes | memoryview) -> list[Any]:
    """The elements of a small little-endian tensor (bf16 widened to float)."""
    n = spec.numel
    if spec.dtype is DType.BF16:
        halves = struct.unpack(f"<{n}H", bytes(data))
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    return list(struct.unpack(f"<{n}{_STRUCT[spec.dtype]}", bytes(data)))


def _value_text(spec: TensorSpec, data: bytes | memoryview) -> str:
    if spec.numel > _SHOWN_ELEMENTS:
        return f"{spec} ({nbytes(spec.nbytes)})"
    values = [f"{v:.6g}" if isinstance(v, float) else str(v) for v in _values(spec, data)]
    shown = values[0] if not spec.shape else f"[{', '.join(values)}]"
    return f"{shown} ({spec})"


def modes_text(eval_modules: tuple[str, ...], *, shown: int = 6) -> str:
    """The modules an entry ran in eval mode, for people: ``"bn1, layer1.0.bn1 (2)"``."""
    if not eval_modules:
        return "none (every module in train mode)"
    names = ["the model" if n == "" else n for n in eval_modules]
    more = f", ... ({len(names)} modules)" if len(names) > shown else f" ({len(names)})"
    return ", ".join(names[:shown]) + (more if len(names) > 1 else "")


def _count(n: int) -> str:
    return f"{n:,}"


def _state_line(m: Manifest) -> list[str]:
    params = [s for s in m.state if s.kind is StateKind.PARAMETER]
    trainable = sum(s.spec.numel for s in params if s.trainable)
    total = sum(s.spec.numel for s in params)
    out = [
        f"parameters {_count(total)} ({_count(trainable)} trainable) in {len(params)} "
        f"tensors, {nbytes(sum(s.spec.nbytes for s in params))}"
    ]
    for kind in (StateKind.BUFFER, StateKind.OPTIMIZER_STATE, StateKind.GRADIENT):
        those = [s for s in m.state if s.kind is kind]
        if those:
            what = kind.value.replace("_", " ")
            size = nbytes(sum(s.spec.nbytes for s in those))
            out.append(f"          {what}: {len(those)} tensors, {size}")
    return out


def _origin_line(m: Manifest) -> list[str]:
    """Where the initial state comes from, when the bundle does not store all of it."""
    kinds = {s.name: s.kind for s in m.sections}
    stored = [e for e in m.state if kinds[e.section] is SectionKind.TENSOR]
    rule = [e for e in m.state if kinds[e.section] is SectionKind.FILL]
    external = [e for e in m.state if kinds[e.section] is SectionKind.EXTERNAL]
    if not rule and not external:
        return []
    line = f"initial   {len(stored)} stored ({nbytes(sum(e.spec.nbytes for e in stored))})"
    line += f", {len(rule)} by rule"
    if external:
        size = nbytes(sum(e.spec.nbytes for e in external))
        line += f", {len(external)} from a checkpoint ({size}; run with --init-from CKPT)"
    return [line]


def _batch_text(specs: Iterable[Any]) -> str:
    return ", ".join(f"{b.name}: {b.spec}" for b in specs) or "(none)"


def precision_text(bundle: Any) -> str:
    """The bundle's matmul precision, or that it records none (format 1.0-1.1)."""
    from stepbundle.schema.version import MATMUL_PRECISION_SINCE

    if tuple(bundle.version) < MATMUL_PRECISION_SINCE:
        return "not recorded (format 1.0-1.1): the programs' own"
    return str(bundle.manifest.matmul_precision)


def summary_lines(bundle: Any, shown: str) -> list[str]:
    """The summary of an open ``Bundle`` (named ``shown``): reads its manifest and its
    small constants."""
    m: Manifest = bundle.manifest
    programs = sum(s.length for s in m.sections if s.kind is SectionKind.PROGRAM)
    state = sum(s.spec.nbytes for s in m.state)
    out = [
        f"bundle    {shown}",
        f"digest    {bundle.digest}",
        f"format    {bundle.version[0]}.{bundle.version[1]}   size {nbytes(bundle.file_size)} "
        f"(state {nbytes(state)}, programs {nbytes(programs)})",
        f"producer  stepbundle {m.producer.stepbundle}, torch {m.producer.torch}, "
        f"torch_xla {m.producer.torch_xla}, jax {m.producer.jax}",
    ]
    keys = [k for k in _FIRST_KEYS if k in m.metadata]
    keys += sorted(k for k in m.metadata if k not in _FIRST_KEYS)
    out += [f"{k:9s} {m.metadata[k]}" for k in keys]
    if m.required_features:
        out.append(f"requires  {', '.join(m.required_features)}")
    if m.numerics is not None:
        out.append(f"numerics  {m.numerics}")
    out.append(f"matmul    precision {precision_text(bundle)}")
    out += _state_line(m)
    out += _origin_line(m)
    if m.hyperparameters:
        out.append("hyperparameters (set with --set NAME=VALUE or a schedule):")
        out += [f"  {h.name} = {h.value!r} ({h.spec})" for h in m.hyperparameters]
    if m.rng is not None:
        out.append(f"rng       seed {m.rng.seed} ({m.rng.rule}), set with --seed")
        if m.rng.restored_after_draws or m.rng.step_after_draws:
            out.append(
                "          RNG state restored mid-step (activation checkpointing): restored "
                f"seeds after {list(m.rng.restored_after_draws)} draws, derived in the program; "
                f"each next seed follows {m.rng.step_after_draws} draws"
            )
    for name, entry in m.entries.items():
        kind = "updates the state" if entry.updates_state else "read-only"
        out += ["", f"entry {name!r} ({kind}), {len(entry.programs)} shape bucket(s):"]
        label = "batch  " if len(entry.programs) == 1 else "batches"
        out.append(f"  {label}  {' | '.join(_batch_text(p.batch) for p in entry.programs)}")
        first = entry.programs[0]
        metrics = [o for o in first.outputs if isinstance(o, MetricOutput)]
        out.append(f"  metrics  {', '.join(f'{o.name}: {o.spec}' for o in metrics) or '(none)'}")
        out.append(f"  eval mode  {modes_text(entry.eval_modules)}")
        constants: dict[str, tuple[ConstantInput, int, int]] = {}
        for i, p in enumerate(entry.programs):
            for j, inp in enumerate(p.inputs):
                if isinstance(inp, ConstantInput) and inp.section not in constants:
                    constants[inp.section] = (inp, i, j)
        if constants:
            out.append(
                "  constants (values the exporter saw unchanged in both traced steps, "
                "frozen into the program):"
            )
            for inp, i, j in constants.values():
                data = bundle.section(inp.section) if inp.spec.numel <= _SHOWN_ELEMENTS else b""
                where = f"input {j} of {name}[{i}]"
                out.append(f"    {inp.name} = {_value_text(inp.spec, data)}, {where}")
    out += ["", "(stepbundle inspect --full: every binding, output and section; --json)"]
    return out
