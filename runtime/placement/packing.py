"""State packing: small state tensors live in one device buffer per dtype.

Every buffer a step passes or returns has a fixed host cost in the PJRT call, so a model
with hundreds of small parameters and optimizer moments spends more time handing over
buffers than computing. With packing, the runtime keeps every state tensor of at most
``max_elements`` elements that the training step reads in one flat buffer per dtype,
and compiles each program behind a wrapper ``@main`` that slices the members out of the
packed buffers, calls the original program, and concatenates the new values back. The
packed buffers are donated and aliased like any other state, so XLA updates them in
place. Large tensors stay separate buffers: copying them into a concatenation every step
would cost more than it saves.

The bundle's programs are not changed: the wrapper is built at load, from the manifest's
tables. The exporter records whether a bundle should be packed (``StatePacking``), and
``StateOptions(pack_state=...)`` can override it.

Imports: stepbundle.schema, stepbundle.stablehlo.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

from stepbundle.schema.manifest import (
    DType,
    InputBinding,
    InputKind,
    Manifest,
    OutputBinding,
    Program,
    StateInput,
    StateUpdateOutput,
    TensorSpec,
)
from stepbundle.stablehlo import artifact as mlir

__all__ = ["DEFAULT_MAX_ELEMENTS", "Layout", "Member", "Pack", "plan_layout", "wrap_program"]

DEFAULT_MAX_ELEMENTS = 65536
"""Measured on the benchmarks' depth-32 MLP (32 x (Linear(16, 16), LayerNorm(16), GELU),
``benchmarks/models.py``): packing tensors up to 64Ki elements cut the
step to a tenth; packing larger ones too made a wide model slower (every packed tensor is
copied into the concatenation each step)."""

_MLIR_ELEMENT = {"bool": "i1", "u8": "ui8", "u16": "ui16", "u32": "ui32", "u64": "ui64"}


@dataclass(frozen=True)
class Member:
    """One state tensor inside a pack: ``numel`` elements from ``offset``, shaped ``shape``."""

    state: str
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Pack:
    """One flat device buffer holding several state tensors of one dtype."""

    name: str
    dtype: DType
    members: tuple[Member, ...]

    @cached_property  # read once per member while the wrapper is built
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @cached_property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.dtype, (self.numel,))


@dataclass(frozen=True)
class Layout:
    """How the runtime holds the state: its device buffers, in order.

    ``buffers[i]`` is a state name (a tensor held on its own) or a ``Pack``.
    """

    buffers: tuple[str | Pack, ...]

    @property
    def packs(self) -> tuple[Pack, ...]:
        return tuple(b for b in self.buffers if isinstance(b, Pack))

    def member_of(self) -> dict[str, tuple[Pack, Member]]:
        return {m.state: (p, m) for p in self.packs for m in p.members}

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return tuple(b.name if isinstance(b, Pack) else b for b in self.buffers)


def unpacked(manifest: Manifest) -> Layout:
    """One buffer per state tensor."""
    return Layout(tuple(s.name for s in manifest.state))


def plan_layout(manifest: Manifest, max_elements: int, keep_apart: Collection[str] = ()) -> Layout:
    """Pack every state tensor of 1..max_elements elements that all training programs read.

    A dtype gets a pack only when it has at least two such tensors. Tensors named in
    ``keep_apart`` stay buffers of their own (ZeRO-1 splits them over devices).
    """
    train = manifest.entries.get("train")
    if train is None or max_elements <= 0:
        return unpacked(manifest)
    read_by_all: set[str] | None = None
    for program in train.programs:
        names = {i.name for i in program.inputs if isinstance(i, StateInput)}
        read_by_all = names if read_by_all is None else read_by_all & names
    read = read_by_all or set()
    groups: dict[DType, list[Member]] = {}
    offsets: dict[DType, int] = {}
    for s in manifest.state:
        n = s.spec.numel
        if s.name in read and 0 < n <= max_elements and s.name not in keep_apart:
            off = offsets.get(s.spec.dtype, 0)
            groups.setdefault(s.spec.dtype, []).append(Member(s.name, off, n, s.spec.shape))
            offsets[s.spec.dtype] = off + n
    packs = [
        Pack(f"pack.{dtype.value}", dtype, tuple(members))
        for dtype, members in groups.items()
        if len(members) >= 2
    ]
    packed = {m.state for p in packs for m in p.members}
    singles = tuple(s.name for s in manifest.state if s.name not in packed)
    return Layout((*packs, *singles))


def _type(spec: TensorSpec) -> str:
    element = _MLIR_ELEMENT.get(spec.dtype.value, spec.dtype.value)
    return f"tensor<{''.join(f'{d}x' for d in spec.shape)}{element}>"


def _i64_array(values: Sequence[int]) -> str:
    return f"array<i64: {', '.join(str(v) for v in values)}>"


def _opaque_offsets(packs: Sequence[Pack], lines: list[str]) -> dict[tuple[int, int], str]:
    """Every member's offset as an i64 scalar XLA cannot see as a constant.

    Why: with static slices (``stablehlo.slice`` at constant offsets), XLA fuses each
    slice into the kernels that read the member, with its offset baked in, so kernels
    that compute the same thing for different members differ, and XLA's CPU backend
    compiles every distinct kernel on its own: a deep MLP's program compiled ten times
    slower packed than unpacked (docs/runtime.md, "State packing", has the figures).
    With ``dynamic_slice`` at an offset the kernel receives as an operand, kernels that
    differ only in the offset are one kernel again.

    A plain constant offset would be folded back into a static slice, so the offsets
    are laundered through a ``stablehlo.while`` that runs once, built so XLA can
    neither drop it nor compute its results at compile time:

    - its trip count is ``replica_id() + 1``, which XLA does not fold (it is 1 on every
      device: the runtime compiles with one replica, data parallelism uses
      partitions), so the loop is not removed as a known single trip;
    - each offset enters as ``offset - 1`` and the body adds ``trip - i`` (1 on the
      only iteration) rather than a constant, so the simplifier can neither forward
      the offsets as loop invariants nor merge them into one induction variable plus
      constants (it did both with a constant step, which restored the constants).

    The values are exactly the offsets, so the results are bit for bit those of static
    slices (tests/runtime/test_runtime_step.py compares packed and unpacked runs and
    checks that the compiled program reads the packs at offsets XLA did not fold).
    """
    members = [(pi, j, m.offset) for pi, p in enumerate(packs) for j, m in enumerate(p.members)]
    i64 = "tensor<i64>"

    def const(name: str, value: int) -> str:
        return f'{name} = "stablehlo.constant"() {{value = dense<{value}> : {i64}}} : () -> {i64}'

    lines.append('%pk_rid = "stablehlo.replica_id"() : () -> tensor<ui32>')
    lines.append(f'%pk_ridl = "stablehlo.convert"(%pk_rid) : (tensor<ui32>) -> {i64}')
    lines.append(const("%pk_one", 1))
    lines.append(const("%pk_zero", 0))
    lines.append(f'%pk_trip = "stablehlo.add"(%pk_ridl, %pk_one) : ({i64}, {i64}) -> {i64}')
    for q, (_, _, offset) in enumerate(members):
        lines.append(const(f"%pk_o{q}", offset - 1))
    n = 2 + len(members)  # the counter, the trip count, the offsets
    types = ", ".join([i64] * n)
    carried = ["%i", "%trip", *(f"%o{q}" for q in range(len(members)))]
    block = f"    ^bb0({', '.join(f'{c}: {i64}' for c in carried)}):\n"
    cond = (
        block + f'      %more = "stablehlo.compare"(%i, %trip) {{comparison_direction = '
        f"#stablehlo<comparison_direction LT>}} : ({i64}, {i64}) -> tensor<i1>\n"
        + '      "stablehlo.return"(%more) : (tensor<i1>) -> ()\n'
    )
    body = [
        f'      %step = "stablehlo.subtract"(%trip, %i) : ({i64}, {i64}) -> {i64}\n',
        f'      %next = "stablehlo.add"(%i, %step) : ({i64}, {i64}) -> {i64}\n',
    ]
    body += [
        f'      %p{q} = "stablehlo.add"(%o{q}, %step) : ({i64}, {i64}) -> {i64}\n'
        for q in range(len(members))
    ]
    updated = ["%next", "%trip", *(f"%p{q}" for q in range(len(members)))]
    body.append(f'      "stablehlo.return"({", ".join(updated)}) : ({types}) -> ()\n')
    init = ["%pk_zero", "%pk_trip", *(f"%pk_o{q}" for q in range(len(members)))]
    lines.append(
        f'%pk_w:{n} = "stablehlo.while"({", ".join(init)}) ({{\n'
        + cond
        + "    }, {\n"
        + block
        + "".join(body)
        + f"    }}) : ({types}) -> ({types})"
    )
    return {(pi, j): f"%pk_w#{2 + q}" for q, (pi, j, _) in enumerate(members)}


def wrap_program(
    module: mlir.Module, program: Program, layout: Layout
) -> tuple[mlir.Module, Program]:
    """Put ``program`` behind a ``@main`` that takes and returns packed state.

    Returns the new module and the program's tables as the runtime feeds it: a pack is
    bound like a state tensor named after the pack (``pack.f32``), and its update
    donates the pack's input, so the trainer's ordinary slots drive the wrapper.
    """
    where = layout.member_of()
    used = [
        p
        for p in layout.packs
        if any(
            (isinstance(row, StateInput) and row.name in {m.state for m in p.members})
            for row in program.inputs
        )
        or any(
            (isinstance(row, StateUpdateOutput) and row.state in {m.state for m in p.members})
            for row in program.outputs
        )
    ]
    if not used:
        return module, program
    pack_arg = {p.name: f"%pack{i}" for i, p in enumerate(used)}
    lines: list[str] = []
    new_inputs: list[InputBinding] = []
    new_args: list[str] = []
    for p in used:
        new_inputs.append(StateInput(InputKind.OPTIMIZER_STATE, p.name, p.spec))
        new_args.append(f"{pack_arg[p.name]}: {_type(p.spec)}")
    # The value of every packed state tensor, sliced out of its pack at its offset.
    offset_of = _opaque_offsets(used, lines)
    sliced: dict[str, str] = {}
    for pi, p in enumerate(used):
        for j, m in enumerate(p.members):
            flat = TensorSpec(p.dtype, (m.numel,))
            s = f"%{p.name.replace('.', '_')}_s{j}"
            lines.append(
                f'{s} = "stablehlo.dynamic_slice"({pack_arg[p.name]}, {offset_of[(pi, j)]}) '
                f"{{slice_sizes = {_i64_array([m.numel])}}} : ({_type(p.spec)}, tensor<i64>) "
                f"-> {_type(flat)}"
            )
            r = f"{s}r"
            lines.append(
                f'{r} = "stablehlo.reshape"({s}) : ({_type(flat)}) -> {_type(TensorSpec(p.dtype, m.shape))}'
            )
            sliced[m.state] = r
    call_args: list[str] = []
    call_types: list[str] = []
    for i, row in enumerate(program.inputs):
        call_types.append(_type(row.spec))
        if isinstance(row, StateInput) and row.name in where:
            call_args.append(sliced[row.name])
        else:
            arg = f"%a{i}"
            new_args.append(f"{arg}: {_type(row.spec)}")
            new_inputs.append(row)
            call_args.append(arg)
    result_types = [_type(o.spec) for o in program.outputs]
    lines.append(
        f'%res:{len(program.outputs)} = "func.call"({", ".join(call_args)}) {{callee = @stepbundle_step}} '
        f": ({', '.join(call_types)}) -> ({', '.join(result_types)})"
    )
    updated = {
        row.state: f"%res#{j}"
        for j, row in enumerate(program.outputs)
        if isinstance(row, StateUpdateOutput) and row.state in where
    }
    returns: list[str] = []
    return_types: list[str] = []
    new_outputs: list[OutputBinding] = []
    pack_input_index = {p.name: i for i, p in enumerate(used)}
    for p in used:
        if not any(m.state in updated for m in p.members):
            continue
        parts = []
        for j, m in enumerate(p.members):
            if m.state in updated:
                flat = TensorSpec(p.dtype, (m.numel,))
                f = f"%{p.name.replace('.', '_')}_u{j}"
                lines.append(
                    f'{f} = "stablehlo.reshape"({updated[m.state]}) : '
                    f"({_type(TensorSpec(p.dtype, m.shape))}) -> {_type(flat)}"
                )
                parts.append((f, flat))
            else:  # not changed by this program: its old value goes back in
                parts.append((f"%{p.name.replace('.', '_')}_s{j}", TensorSpec(p.dtype, (m.numel,))))
        c = f"%{p.name.replace('.', '_')}_new"
        lines.append(
            f'{c} = "stablehlo.concatenate"({", ".join(x for x, _ in parts)}) {{dimension = 0 : i64}} '
            f": ({', '.join(_type(t) for _, t in parts)}) -> {_type(p.spec)}"
        )
        returns.append(c)
        return_types.append(_type(p.spec))
        new_outputs.append(StateUpdateOutput(p.name, p.spec, pack_input_index[p.name]))
    position = {id(row): k for k, row in enumerate(new_inputs)}
    for j, out in enumerate(program.outputs):
        if isinstance(out, StateUpdateOutput) and out.state in where:
            continue
        returns.append(f"%res#{j}")
        return_types.append(_type(out.spec))
        if isinstance(out, StateUpdateOutput) and out.donates is not None:
            donor = program.inputs[out.donates]
            out = StateUpdateOutput(out.state, out.spec, position[id(donor)])
        new_outputs.append(out)
    lines.append(f'"func.return"({", ".join(returns)}) : ({", ".join(return_types)}) -> ()')
    wrapper = (
        f"  func.func @main({', '.join(new_args)}) -> ({', '.join(return_types)}) {{\n"
        + "".join(f"    {line}\n" for line in lines)
        + "  }\n"
    )
    # The wrapper is parsed on its own (it declares the step it calls) and moved into
    # the module; the module's own text is never edited.
    module.replace_main(
        "stepbundle_step",
        "module {\n"
        f"  func.func private @stepbundle_step({', '.join(call_types)}) -> "
        f"({', '.join(result_types)})\n" + wrapper + "}\n",
    )
    return module, Program(
        section=program.section,
        stablehlo_version=program.stablehlo_version,
        inputs=tuple(new_inputs),
        outputs=tuple(new_outputs),
        batch=program.batch,
        platforms=program.platforms,
        text_section=program.text_section,
    )
