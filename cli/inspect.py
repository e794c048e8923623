"""``stepbundle inspect`` and ``stepbundle verify``: read a bundle without running it.

``inspect`` prints a summary (``summary.py``) by default, every binding with ``--full``.
A bundle given as a URL or ``sha256:<digest>`` is found through the runtime's bundle
store (which imports jax); a local path needs only the schema.

Imports: stepbundle.schema (no jax, no torch); stepbundle.runtime.io.store for URLs.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from typing import Any

from .common import die as _die
from .common import is_remote
from .summary import modes_text, precision_text, summary_lines
from .summary import nbytes as _nbytes

__all__ = ["cmd_inspect", "cmd_verify"]


# struct formats of one element, by dtype ("bf16" is the high half of an f32).
_ELEMENT = {"f64": "<d", "f32": "<f", "f16": "<e", "i64": "<q", "i32": "<i", "i16": "<h"}
_ELEMENT |= {"i8": "<b", "u64": "<Q", "u32": "<I", "u16": "<H", "u8": "<B", "bool": "<?"}


def _origin(bundle: Any, entry: Any) -> str:
    """Where a state entry's initial value comes from: the bundle, a rule, or a file."""
    from stepbundle.schema import SectionKind

    kind = bundle.manifest.section(entry.section).kind
    if kind is SectionKind.EXTERNAL:
        return "from file"
    if kind is not SectionKind.FILL:
        return "stored"
    data = bytes(bundle.section(entry.section))
    if not any(data):
        return "zeros"
    dtype = entry.spec.dtype.value
    if dtype == "bf16":
        (value,) = struct.unpack("<f", b"\0\0" + data)
    else:
        (value,) = struct.unpack(_ELEMENT[dtype], data)
    return "ones" if value == 1 else f"fill {value!r}"


def _describe(bundle: Any) -> dict[str, Any]:
    from stepbundle.schema.wire import manifest_to_wire

    m = bundle.manifest
    wire = manifest_to_wire(m)
    return {
        "digest": bundle.digest,
        "path": os.fspath(bundle.path),
        "file_size": bundle.file_size,
        "format_version": list(bundle.version),
        **wire,
    }


def _open(text: str) -> Any:
    """Open the bundle ``text`` names: a path, or a URL or digest through the store."""
    from stepbundle.schema import open_bundle

    if not is_remote(text):
        return open_bundle(text)
    from stepbundle.runtime.io.store import resolve_bundle

    return open_bundle(resolve_bundle(text))


def cmd_inspect(args: argparse.Namespace) -> int:
    from stepbundle.schema.errors import StepbundleError
    from stepbundle.schema.manifest import StateUpdateOutput

    try:
        bundle = _open(args.bundle)
    except StepbundleError as e:
        return _die(str(e), 1)
    except OSError as e:
        return _die(f"cannot open the bundle {args.bundle!r}: {e.strerror}.", 2)
    with bundle:
        if args.json:
            print(json.dumps(_describe(bundle), indent=2))
            return 0
        if not args.full:
            try:
                print("\n".join(summary_lines(bundle, args.bundle)))
            except StepbundleError as e:  # a damaged constant section
                return _die(str(e), 1)
            return 0
        m = bundle.manifest
        out = [
            f"bundle    {args.bundle}",
            f"digest    {bundle.digest}",
            f"format    {bundle.version[0]}.{bundle.version[1]}   size {_nbytes(bundle.file_size)}",
            f"producer  stepbundle {m.producer.stepbundle}, torch {m.producer.torch}, "
            f"torch_xla {m.producer.torch_xla}, jax {m.producer.jax}",
        ]
        out += [f"metadata  {k} = {v}" for k, v in m.metadata.items()]
        if m.numerics is not None:
            out.append(f"numerics  {m.numerics}")
        out.append(f"matmul    precision {precision_text(bundle)}")
        if m.required_features:
            out.append(f"requires  {', '.join(m.required_features)}")
        if m.rng is not None:
            out.append(f"rng       seed {m.rng.seed} ({m.rng.rule})")
            if m.rng.restored_after_draws or m.rng.step_after_draws:
                out.append(
                    "          RNG state restored mid-step (activation checkpointing): restored "
                    f"seeds after {list(m.rng.restored_after_draws)} draws, derived in the program; "
                    f"each next seed follows {m.rng.step_after_draws} draws"
                )
        for h in m.hyperparameters:
            out.append(f"hyper     {h.name} = {h.value!r} ({h.spec})")
        for name, entry in m.entries.items():
            out.append("")
            out.append(
                f"entry {name!r}: {len(entry.programs)} program(s), "
                + ("updates state" if entry.updates_state else "read-only")
            )
            out.append(f"  modules in eval mode: {modes_text(entry.eval_modules, shown=10**6)}")
            for i, p in enumerate(entry.programs):
                batch = ", ".join(f"{b.name}: {b.spec}" for b in p.batch)
                out.append(
                    f"  program {i}: batch {{{batch}}}  StableHLO {p.stablehlo_version}  section {p.section}"
                )
                out.append(f"    inputs ({len(p.inputs)}):")
                for j, inp in enumerate(p.inputs):
                    label = getattr(inp, "name", "rng_seed")
                    out.append(f"      {j:4d}  {inp.kind.value:16s} {label:48s} {inp.spec}")
                out.append(f"    outputs ({len(p.outputs)}):")
                for j, o in enumerate(p.outputs):
                    if isinstance(o, StateUpdateOutput):
                        alias = (
                            f"donates input {o.donates}"
                            if o.donates is not None
                            else "no input to donate"
                        )
                        out.append(
                            f"      {j:4d}  state_update     {o.state:48s} {o.spec}  {alias}"
                        )
                    else:
                        out.append(f"      {j:4d}  metric           {o.name:48s} {o.spec}")
        out.append("")
        total = stored = 0
        out.append(f"state ({len(m.state)} tensors):")
        for s in m.state:
            total += s.spec.nbytes
            origin = _origin(bundle, s)
            stored += s.spec.nbytes if origin == "stored" else 0
            flag = "trainable" if s.trainable else ""
            alias = f"  aka {', '.join(s.aliases)}" if s.aliases else ""
            out.append(
                f"  {s.kind.value:16s} {s.name:52s} {str(s.spec):20s} {_nbytes(s.spec.nbytes):>10s} "
                f"{origin:10s} {flag}{alias}"
            )
        out.append(f"  total {_nbytes(total)}, {_nbytes(stored)} of it stored in the bundle")
        out.append("")
        out.append(f"sections ({len(m.sections)}):")
        for sec in m.sections:
            out.append(
                f"  {sec.kind.value:8s} {sec.name:52s} {sec.length:>10d} B  sha256:{sec.sha256[:16]}…"
            )
        print("\n".join(out))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from stepbundle.schema.errors import StepbundleError

    try:
        bundle = _open(args.bundle)
    except StepbundleError as e:
        print(f"FAILED {args.bundle}: {e}")
        return 1
    except OSError as e:
        print(f"FAILED {args.bundle}: cannot open it: {e.strerror}.")
        return 1
    with bundle:
        failures = bundle.verify()
        if failures:
            for f in failures:
                print(f"FAILED {f}")
            return 1
        print(f"OK {args.bundle} {bundle.digest} ({len(bundle.manifest.sections)} sections)")
    return 0
