"""The two front-ends' bundles of one model, compiled for a TPU v5e without one, compared
operation by operation in the optimized program.

    # the bundles (here; weights-free, export check off)
    .venv/bin/python benchmarks/device/attention_table.py export -o build/h38p --frontend torch_xla --models gpt55m_sdpa
    .venv-torch/bin/python benchmarks/device/attention_table.py export -o build/h38p --frontend torch --models gpt55m_sdpa
    # each compiled for one chip of a v5e with libtpu (jax[tpu]), no TPU attached
    python benchmarks/device/torch_frontend_hlo.py compile --dump build/h38p/hlo \\
        torch_xla=build/h38p/gpt55m_sdpa-torch_xla.stepbundle torch=build/h38p/gpt55m_sdpa-torch.stepbundle
    # the comparison, merged into the results file under a label (the commit it measured)
    python benchmarks/device/torch_frontend_hlo.py compare --dump build/h38p/hlo \\
        --label "torch front-end at <commit>" torch_xla torch

``compile`` runs ``stepbundle.runtime.offline.compile_offline`` (``load``'s own checks,
rewrites, fused attention kernels and compile options) for a compile-only device of
``jax.experimental.topologies``' ``v5e:2x2`` and writes, per bundle, the optimized HLO
(``NAME.hlo.txt``) and XLA's cost analysis and memory plan (``NAME.json``).

``compile --variant`` is an experiment, not a lowering: it compiles the bundle's train
program with one of its differences from torch_xla's taken away in the text
(``layout-attributes``: torch_xla's ``result_layout``/``xla_shape`` on every transpose;
``bf16-products``: each bf16 x bf16 product written float32-out and then converted to
bf16 written bf16-out, alone (the runtime's ``stablehlo/bf16_products.py`` also swaps the
weight gradients' operands, below);
``fold-transposes``: each 2-D transpose a product reads folded into the product's
contracting dimensions; ``residual-barriers``: an optimization barrier on each float32
activation-sized ``add`` of a chain of at least 4 (the residual stream and its gradient's
sums), ``residual-barriers-forward`` on the forward's only), through the runtime's
``compile_program`` (with every rewrite a TPU load makes but the load's own choices: no
head barriers, no bf16-out products), to see what that difference costs before changing
a lowering for it. ``compile --as-written`` compiles the bundles without the
``bf16-products`` rewrite the runtime makes on a TPU (``CompileOptions.bf16_products``);
``compile --defaults`` as a load does by default (head barriers weighed, "auto"), and
records what the load decided (``head_barriers``, ``bf16_products``).

``compare`` reads them. libtpu writes its cost model's ``estimated_cycles`` into the
``backend_config`` of every top-level operation it schedules; the sum, at the v5e's
1.5 GHz (197 TFLOP/s over 4 MXUs of 128 x 128 multiply-adds a cycle), is an estimate of
the step's device time, which this file splits by kind of operation:

- ``matmul``: a fusion holding a convolution (XLA's TPU form of a matrix product) with
  what XLA fused into it;
- ``kernel``: the Pallas attention kernels (no estimate: libtpu's model does not price
  them; both front-ends call the same ones);
- ``copy/transpose``: layout changes;
- ``other``: element-wise and reduction fusions, gathers, scatters, broadcasts;
- ``scalar``: operations on a few bytes (the optimizer's per-tensor step arithmetic);
- ``async``: the halves of asynchronous copies (no estimate).

Each kind is split again by whether the result is vocabulary-shaped (the LM head and the
loss). For every kind it records the count and the estimated ms, the largest operations,
and for copies the estimate summed per result shape, which is where two programs of the
same model differ most. It is an estimate from the compiler, not a measurement: the
device's own profile (``attention_table.py bench --profile``) is the measurement.

The estimate does not attribute operations to the step's regions (forward, backward,
optimizer): after fusion one operation often holds parts of two, and torch_xla's lazy
graph is not written in program order.

Imports: jax (with libtpu) and stepbundle for ``compile``; the standard library for
``compare``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "torch_frontend_hlo.json"
CLOCK_HZ = 1.5e9  # a v5e TensorCore: 197e12 / (4 * 128 * 128 * 2)
VOCAB = 16384  # the 55M GPT's

sys.path.insert(0, str(HERE))
from profile_categories import _CALLS, _holds_product, computations  # noqa: E402

from stepbundle.stablehlo.head_barriers import MODES, head_barrier_text  # noqa: E402

_OP = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\(")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_ARRAY = re.compile(r"\b(pred|[a-z]+[0-9]+)\[([0-9,]*)\]")
_TILING = re.compile(r":T\([^}]*\}")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip


def _nbytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES.get(dtype, 4)
    return total


def _kind(comps: dict[str, list[str]], name: str, shape: str, op: str, line: str) -> str:
    if " convolution(" in line or any(_holds_product(comps, c, {c}) for c in _CALLS.findall(line)):
        kind = "matmul"
    elif "tpu_custom_call" in line:
        kind = "kernel"
    elif op.endswith(("-start", "-done")):
        kind = "async"
    elif op in ("copy", "transpose"):
        kind = "copy/transpose"
    elif _nbytes(shape) <= 8:
        kind = "scalar"
    else:
        kind = "other"
    first = shape.split(" ")[0]
    if f"{VOCAB}]" in first or f",{VOCAB}" in first or f"{VOCAB}," in first:
        kind += ", vocab-shaped"
    return kind


def summarize(hlo: str, top: int = 8) -> dict[str, Any]:
    """The estimate of ``hlo``'s entry computation, by kind of operation."""
    comps = computations(hlo)
    cycles: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    copies: collections.Counter[str] = collections.Counter()
    copy_count: collections.Counter[str] = collections.Counter()
    largest: list[tuple[int, str, str, str]] = []
    for line in comps.get("ENTRY", []):
        m = _OP.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        if op in ("parameter", "constant", "get-tuple-element", "bitcast", "tuple"):
            continue
        found = _CYCLES.search(line)
        c = int(found.group(1)) if found else 0
        kind = _kind(comps, name, shape, op, line)
        cycles[kind] += c
        count[kind] += 1
        short = _TILING.sub("}", shape)[:500]
        if kind.startswith("copy"):
            copies[short] += c
            copy_count[short] += 1
        largest.append((c, kind, name, short))
    largest.sort(reverse=True)

    def ms(c: int) -> float:
        return round(c / CLOCK_HZ * 1e3, 3)

    return {
        "estimated_ms": ms(sum(cycles.values())),
        "kinds": {k: {"ops": count[k], "estimated_ms": ms(v)} for k, v in cycles.most_common()},
        "copies_by_shape": [
            {"shape": s, "ops": copy_count[s], "estimated_ms": ms(v)}
            for s, v in copies.most_common(top)
        ],
        "largest": [
            {"op": n, "kind": k, "result": s, "estimated_ms": ms(c)}
            for c, k, n, s in largest[: top * 3]
        ],
    }


# ---------------------------------------------------------------------------- variants
# Experiments on a bundle's program text, not lowerings: what XLA makes of the torch
# front-end's program with one of its differences from torch_xla's taken away.
_TRANSPOSE = re.compile(
    r"(stablehlo\.transpose %[\w#]+, dims = \[([\d, ]+)\]) : "
    r"\(tensor<([\dx]+)x(bf16|f32)>\) -> tensor<([\dx]+)x(bf16|f32)>"
)
_DOT = re.compile(
    r"\s*(%\w+) = stablehlo\.dot_general .*\(tensor<[\dx]+xbf16>, tensor<[\dx]+xbf16>\) "
    r"-> tensor<[\dx]+xf32>$"
)
_CONVERT = r"(\s*%\w+) = stablehlo\.convert {} : \(tensor<([\dx]+)xf32>\) -> tensor<([\dx]+)xbf16>$"


def layout_attributes(text: str) -> tuple[str, int]:
    """torch_xla's ``result_layout``/``xla_shape`` on every transpose: the layout that
    makes it a relabelling of its operand's row-major bytes."""

    def annotate(m: re.Match[str]) -> str:
        dims = [int(x) for x in m.group(2).split(",")]
        inverse = [dims.index(i) for i in range(len(dims))]
        layout = [inverse[i] for i in reversed(range(len(dims)))]
        shape = m.group(5).replace("x", ",")
        ls = ", ".join(map(str, layout))
        xla = f"{m.group(6)}[{shape}]{{{','.join(map(str, layout))}}}"
        return (
            f"{m.group(1)} {{result_layout = dense<[{ls}]> : tensor<{len(dims)}xindex>, "
            f'xla_shape = "{xla}"}} : (tensor<{m.group(3)}x{m.group(4)}>) -> '
            f"tensor<{m.group(5)}x{m.group(6)}>"
        )

    return _TRANSPOSE.subn(annotate, text)


def bf16_products(text: str) -> tuple[str, int]:
    """Each bf16 x bf16 -> f32 product whose one use is the next line's convert to bf16
    written as a bf16 -> bf16 product (torch_xla's form; the convert left a no-op)."""
    lines = text.split("\n")
    uses = collections.Counter(
        u for ln in lines for u in re.findall(r"%\w+", ln.split(" = ", 1)[-1])
    )
    n = 0
    for i in range(len(lines) - 1):
        d = _DOT.match(lines[i])
        if not d or uses[d.group(1)] != 1:
            continue
        c = re.match(_CONVERT.format(re.escape(d.group(1))), lines[i + 1])
        if not c:
            continue
        lines[i] = lines[i][: -len("xf32>")] + "xbf16>"
        lines[i + 1] = (
            f"{c.group(1)} = stablehlo.convert {d.group(1)} : "
            f"(tensor<{c.group(2)}xbf16>) -> tensor<{c.group(3)}xbf16>"
        )
        n += 1
    return "\n".join(lines), n


def fold_transposes(text: str) -> tuple[str, int]:
    """Each matrix product (no batch dimensions) of a 2-D operand that is a transpose
    written as the product of the transpose's operand, its contracting dimension moved
    (no explicit transpose left for XLA to fold: it folded them already, the estimate
    did not move)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo as hlo

    from stepbundle.stablehlo.graph import producer

    n = 0
    module = ir.Module.parse(text)  # in the program's own context (``_compile_variant``)
    stack = [module.operation]
    dots = []
    while stack:
        op = stack.pop()
        if op.name == "stablehlo.dot_general":
            dots.append(op)
        for region in op.regions:
            for block in region.blocks:
                stack.extend(o.operation for o in block.operations)
    for op in dots:
        dn = hlo.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
        if list(dn.lhs_batching_dimensions) or list(dn.rhs_batching_dimensions):
            continue
        contracting = [list(dn.lhs_contracting_dimensions), list(dn.rhs_contracting_dimensions)]
        changed = False
        for side in (0, 1):
            t = producer(op.operands[side])
            if t is None or t.name != "stablehlo.transpose":
                continue
            if list(ir.DenseI64ArrayAttr(t.attributes["permutation"])) != [1, 0]:
                continue
            op.operands[side] = t.operands[0]
            contracting[side] = [1 - d for d in contracting[side]]
            changed = True
        if changed:
            op.attributes["dot_dimension_numbers"] = hlo.DotDimensionNumbers.get(
                lhs_batching_dimensions=[],
                rhs_batching_dimensions=[],
                lhs_contracting_dimensions=contracting[0],
                rhs_contracting_dimensions=contracting[1],
            )
            n += 1
    assert module.operation.verify()
    return str(module), n


def residual_barriers(text: str, least: int = 4, forward_only: bool = False) -> tuple[str, int]:
    """Each float32 activation-sized ``add`` in a chain of at least ``least`` adds of one
    shape (a transformer's residual stream: ``h = h + block(h)``, and its gradient's
    accumulation) passed through an ``optimization_barrier``, so that XLA reads the
    stream's values where they are used instead of recomputing them from the layers'
    outputs inside a later fusion (frontend_gap-v5e.md, items 4, 7 and 9)."""
    from jaxlib.mlir import ir

    from stepbundle.stablehlo.build import op as build_op
    from stepbundle.stablehlo.graph import producer

    module = ir.Module.parse(text)
    adds: list[Any] = []
    stack = [module.operation]
    while stack:
        o = stack.pop()
        if o.name == "stablehlo.add":
            t = ir.RankedTensorType(o.result.type)
            if str(t.element_type) == "f32" and t.rank >= 2 and math.prod(t.shape) >= 1 << 16:
                adds.append(o)
        for region in o.regions:
            for block in region.blocks:
                stack.extend(x.operation for x in block.operations)
    index = {a.operation: i for i, a in enumerate(adds)}
    parent = list(range(len(adds)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, a in enumerate(adds):
        for v in a.operands:
            p = producer(v)
            if p is not None and p.operation in index and p.result.type == a.result.type:
                parent[find(i)] = find(index[p.operation])
    sizes: dict[int, int] = {}
    for i in range(len(adds)):
        sizes[find(i)] = sizes.get(find(i), 0) + 1
    sites = [a for i, a in enumerate(adds) if sizes[find(i)] >= least]
    if forward_only:  # leave out what comes after the head's product (the backward)
        heads = []
        stack = [module.operation]
        while stack:
            o = stack.pop()
            if (
                o.name == "stablehlo.dot_general"
                and max(ir.RankedTensorType(o.result.type).shape) >= 16384
            ):
                heads.append(o)
            for region in o.regions:
                for block in region.blocks:
                    stack.extend(x.operation for x in block.operations)
        after: set[Any] = set()
        work = list(heads)
        while work:
            o = work.pop()
            for r in o.results:
                for u in r.uses:
                    owner = u.owner.operation if hasattr(u.owner, "operation") else u.owner
                    if owner not in after:
                        after.add(owner)
                        work.append(owner)
        sites = [a for a in sites if a.operation not in after]
    for a in sites:
        with _after_op(a), a.location:
            held = build_op("stablehlo.optimization_barrier", a.result.type, [a.result])
        for use in list(a.result.uses):
            if use.owner != held.owner:
                use.owner.operands[use.operand_number] = held
    assert module.operation.verify()
    return str(module), len(sites)


def _after_op(op: Any) -> Any:
    from jaxlib.mlir import ir

    ops = list(op.operation.block.operations)
    at = next(i for i, o in enumerate(ops) if o.operation == op.operation)
    return ir.InsertionPoint(ops[at + 1])


VARIANTS = {
    "layout-attributes": layout_attributes,
    "bf16-products": bf16_products,
    "fold-transposes": fold_transposes,
    "residual-barriers": residual_barriers,
    "residual-barriers-forward": lambda text: residual_barriers(text, forward_only=True),
    **{  # head_barriers.MODES; "result" keeps the name it was measured under
        ("head-barrier" if mode == "result" else f"head-barrier-{mode}"): functools.partial(
            head_barrier_text, mode=mode
        )
        for mode in MODES
    },
}


def _compile_variant(path: str, variant: str, device: Any) -> tuple[Any, int, int]:
    """The bundle's train program with ``variant`` applied to its text, compiled as the
    runtime compiles it (``compile_program``: checks, rewrites, fused attention)."""
    from compile_offline import _CompileOnly
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo

    from stepbundle.runtime.compile.program import compile_program
    from stepbundle.runtime.entry_compiler import scalar_constants
    from stepbundle.runtime.load import _open_bundle
    from stepbundle.runtime.placement.sharding import Placement
    from stepbundle.stablehlo.artifact import Module, parse_artifact

    bundle = _open_bundle(path, None)
    entry = bundle.manifest.entries["train"]
    program = entry.programs[0]
    module = parse_artifact(bundle.section(program.section))
    with module._ctx:
        text, changed = VARIANTS[variant](module._module.operation.get_asm())
        edited = Module(module._ctx, ir.Module.parse(text))
    compiled = compile_program(
        device.client,
        Placement([device]),
        edited.portable_artifact(stablehlo.get_current_version()),
        program,
        where="train",
        label="train[0]",
        donate=entry.updates_state,
        cache=_CompileOnly(),  # type: ignore[arg-type]
        matmul_precision=bundle.manifest.matmul_precision,
        scalar_constants=scalar_constants(bundle, program),
        head_barriers=False,  # the variant alone, not the load's choice on top
        bf16_products=False,
    )
    return compiled.executable, compiled.fused_attention, changed


# ---------------------------------------------------------------------------- compile
def compile_bundles(
    specs: list[str],
    dump: Path,
    variant: str | None = None,
    as_written: bool = False,
    defaults: bool = False,
) -> None:
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies

    from stepbundle.runtime import CompileOptions, LoadOptions
    from stepbundle.runtime.offline import compile_offline

    device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    dump.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        name, path = spec.split("=", 1)
        extra: dict[str, Any] = {}
        if variant is None:
            # not the load's choice of head barriers (runtime/compile/head_choice.py),
            # but with --defaults
            options = CompileOptions(
                head_barriers="auto" if defaults else False, bf16_products=not as_written
            )
            out = compile_offline(path, [device], LoadOptions(compile=options))
            exe, fused = out.executables["train[0]"], out.fused_attention
            extra = {
                "options": {
                    "head_barriers": options.head_barriers,
                    "bf16_products": not as_written,
                },
                "head_barriers": out.head_barriers,
                "bf16_products": out.bf16_products,
            }
        else:
            exe, n, changed = _compile_variant(path, variant, device)
            fused = {"train[0]": n}
            extra = {"variant": variant, "operations_changed": changed}
        (dump / f"{name}.hlo.txt").write_text("\n".join(m.to_string() for m in exe.hlo_modules()))
        cost = exe.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        mem = exe.get_compiled_memory_stats()
        record = {
            "bundle": str(path),
            **extra,
            "fused_attention": fused,
            "cost": {
                k: cost[k] for k in ("flops", "bytes accessed", "transcendentals") if k in cost
            },
            "temp_bytes": int(mem.temp_size_in_bytes),
        }
        (dump / f"{name}.json").write_text(json.dumps(record, indent=1))
        print(name, json.dumps(record), flush=True)


# ---------------------------------------------------------------------------- compare
def _libtpu_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def compare(names: list[str], dump: Path, label: str, out: Path) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in names:
        record = json.loads((dump / f"{name}.json").read_text())
        rows[name] = {**record, **summarize((dump / f"{name}.hlo.txt").read_text())}
    data = json.loads(out.read_text()) if out.exists() else {}
    data["method"] = (
        "benchmarks/device/torch_frontend_hlo.py: each bundle compiled with "
        "stepbundle.runtime.offline.compile_offline for one compile-only device of a v5e:2x2 "
        "topology (libtpu, no TPU attached, load's defaults: fused attention, the bundle's "
        "matmul precision); libtpu's estimated_cycles of every top-level operation of the "
        "optimized entry computation summed by kind at 1.5 GHz (an estimate, not a "
        "measurement; the Pallas kernels and asynchronous copies carry none); cost is XLA's "
        "cost_analysis, temp_bytes its memory plan"
    )
    data.setdefault("runs", {})[label] = {"libtpu": _libtpu_version(), "rows": rows}
    out.write_text(json.dumps(data, indent=1) + "\n")
    for name, row in rows.items():
        print(f"== {name}: {row['estimated_ms']:.2f} ms estimated, "
              f"{row['cost'].get('bytes accessed', 0) / 1e9:.2f} GB accessed")  # fmt: skip
        for kind, k in row["kinds"].items():
            print(f"  {k['estimated_ms']:8.3f} ms {k['ops']:5d} ops  {kind}")
    return data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile")
    c.add_argument("bundles", nargs="+", metavar="NAME=BUNDLE")
    c.add_argument("--dump", type=Path, required=True)
    c.add_argument("--variant", choices=sorted(VARIANTS), default=None,
                   help="an experiment: the program's text changed so before compiling")  # fmt: skip
    c.add_argument("--defaults", action="store_true",
                   help="as a load compiles it by default: head barriers weighed ('auto')")  # fmt: skip
    c.add_argument("--as-written", action="store_true",
                   help="without the runtime's bf16-products rewrite (CompileOptions.bf16_products)")  # fmt: skip
    k = sub.add_parser("compare")
    k.add_argument("names", nargs="+")
    k.add_argument("--dump", type=Path, required=True)
    k.add_argument("--label", required=True)
    k.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.cmd == "compile":
        compile_bundles(a.bundles, a.dump, a.variant, a.as_written, a.defaults)
    else:
        compare(a.names, a.dump, a.label, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
