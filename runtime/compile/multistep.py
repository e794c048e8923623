"""K training steps per dispatch: the train program behind a loop over K stacked batches.

For small models most of a step is the host's call into PJRT, not the arithmetic; as
Keras's ``steps_per_execution`` and TPU training loops do, ``CompileOptions(steps_per_call=K)``
runs K steps per call. At load, each train program is compiled a second time behind a
wrapper ``@main`` holding a ``stablehlo.while`` loop of K iterations; iteration ``i``

- takes row ``i`` of every stacked batch input (``[K, *shape]``), of the stacked seeds
  (the host computes ``rule^(step+i)(seed)``, the seed single steps would receive) and
  of every stacked hyperparameter (the schedule's value for that step),
- calls the bundle's own program once, unchanged, and
- carries the new state into the next iteration and writes its metrics into row ``i``
  of ``[K, *shape]`` result stacks.

The state goes in and out of the loop once per call; its inputs are donated to its
results as in a single step, so XLA updates it in place. Every iteration runs the same
program on the same values as a single step would, and the results are bit for bit K
single steps' where XLA compiles the loop body's kernels as the single step's
(tests/runtime/test_steps_per_call.py checks state and every metric on the golden
bundles, tests/exporter/test_steps_per_call_conv.py on a CNN). For that the loop body
must give XLA the single step's fusions: the K-step program's convolutions are put in
XLA:CPU's kernel order first (stablehlo/conv_layout.py: XLA does it for the entry
computation only), each step's rows of the stacked inputs are sliced one iteration early
into carries of their own (so no slice is fused into the step's kernels), and metrics are
stored one iteration late (so no store is fused into them). Measured bit for bit on an
AVX-512 Xeon and on an AVX2 EPYC without AVX-512 (jax 0.7.1 and 0.10.2); XLA promises
no kernel choice, so a host or XLA version that emitted a loop body's reduction in another
order would give metrics a float32 rounding apart (docs/runtime.md says so).

The bundle is not changed and nothing is exported again: the wrapper is built from the
manifest's tables (after ``packing.wrap_program``, when the state is packed), and the
tables returned describe the wrapper's arguments and results.

Imports: stepbundle.schema, stepbundle.stablehlo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from stepbundle.schema.errors import UsageError
from stepbundle.schema.manifest import (
    BatchInput,
    DType,
    HyperparameterInput,
    InputBinding,
    MetricOutput,
    NamedSpec,
    OutputBinding,
    Program,
    RngSeedInput,
    StateInput,
    StateUpdateOutput,
    TensorSpec,
)
from stepbundle.stablehlo import artifact as mlir

__all__ = ["INNER", "stacked_spec", "wrap_steps"]

INNER = "stepbundle_one_step"
"""The name the wrapped program's ``@main`` takes inside the K-step module."""

_MLIR_ELEMENT = {"bool": "i1", "u8": "ui8", "u16": "ui16", "u32": "ui32", "u64": "ui64"}


def _element(dtype: DType) -> str:
    return _MLIR_ELEMENT.get(dtype.value, dtype.value)


def _type(spec: TensorSpec) -> str:
    return f"tensor<{''.join(f'{d}x' for d in spec.shape)}{_element(spec.dtype)}>"


def _zero(spec: TensorSpec) -> str:
    """A ``stablehlo.constant`` attribute of zeros of ``spec``."""
    if spec.dtype.value == "bool":
        value = "false"
    elif spec.dtype.value.startswith(("f", "bf")):
        value = "0.0"
    else:
        value = "0"
    return f"dense<{value}> : {_type(spec)}"


def _i64_array(values: Sequence[int]) -> str:
    return f"array<i64: {', '.join(str(v) for v in values)}>"


def stacked_spec(spec: TensorSpec, k: int) -> TensorSpec:
    """``spec`` with a leading axis of ``k`` steps."""
    return TensorSpec(spec.dtype, (k, *spec.shape))


def _is_stacked(row: InputBinding) -> bool:
    """The inputs that change from step to step get one row per step."""
    return isinstance(row, (BatchInput, RngSeedInput, HyperparameterInput))


def wrap_steps(module: mlir.Module, program: Program, k: int) -> tuple[mlir.Module, Program]:
    """Put ``program`` behind a ``@main`` that runs it ``k`` times in a loop.

    The new ``@main`` takes the same inputs in the same order, batch inputs, the seed
    and hyperparameters with a leading axis of ``k`` (one row per step), and returns
    the same outputs in the same order, metrics with a leading axis of ``k``. State
    inputs and updates keep their shapes, so ``StateUpdateOutput.donates`` still names
    the right argument.
    """
    if k < 2:
        raise UsageError(f"wrap_steps needs at least 2 steps per call, got {k}")
    inputs = program.inputs
    outputs = program.outputs
    n_in = len(inputs)
    new_inputs: list[InputBinding] = [
        replace(row, spec=stacked_spec(row.spec, k)) if _is_stacked(row) else row for row in inputs
    ]
    new_outputs: list[OutputBinding] = [
        replace(row, spec=stacked_spec(row.spec, k)) if isinstance(row, MetricOutput) else row
        for row in outputs
    ]
    # The loop carries: the counter, every argument (state is replaced by its update each
    # iteration; everything else passes through unchanged), one slot per state update
    # that reads no input (written each iteration, only the last value is returned), and
    # one stack per metric. Carrying loop-invariant values explicitly keeps the regions
    # free of captured values, which every StableHLO consumer accepts.
    by_name = {row.name: i for i, row in enumerate(inputs) if isinstance(row, StateInput)}
    carry_of_output: dict[int, int] = {}  # output index -> carry index
    carry_types: list[str] = ["tensor<i64>"] + [_type(r.spec) for r in new_inputs]
    init: list[str] = ["%zero"] + [f"%a{i}" for i in range(n_in)]
    lines: list[str] = [
        '%zero = "stablehlo.constant"() {value = dense<0> : tensor<i64>} : () -> tensor<i64>'
    ]
    for j, out in enumerate(outputs):
        if isinstance(out, StateUpdateOutput) and out.state in by_name:
            carry_of_output[j] = 1 + by_name[out.state]
            continue
        spec = new_outputs[j].spec
        name = f"%init{j}"
        lines.append(
            f'{name} = "stablehlo.constant"() {{value = {_zero(spec)}}} : () -> {_type(spec)}'
        )
        carry_of_output[j] = len(init)
        init.append(name)
        carry_types.append(_type(spec))
    # A metric is written into its stack one iteration late, from a carry of its own:
    # written in the iteration that computes it, XLA may fuse its reduction into the
    # dynamic_update_slice that stores it and emit it in another summation order than
    # the single step's kernel (measured: jax 0.7.1 on an AVX-512 Xeon, the batchnorm_lr
    # golden bundle's MSE loss 1 ulp off at step 3, state equal; an optimization barrier
    # does not stop it, XLA:CPU removes barriers before fusion). Read from the carry, the
    # value comes from the previous iteration and cannot be fused with its producer.
    prev_of: dict[int, int] = {}  # metric output index -> carry of its latest value
    for j, out in enumerate(outputs):
        if isinstance(out, MetricOutput):
            name = f"%prev{j}"
            lines.append(
                f'{name} = "stablehlo.constant"() {{value = {_zero(out.spec)}}} : () -> '
                f"{_type(out.spec)}"
            )
            prev_of[j] = len(init)
            init.append(name)
            carry_types.append(_type(out.spec))
    # A stacked input reaches the step from a carry of its own holding the current row,
    # sliced one iteration early (row 0 before the loop, row i + 1 in iteration i): a
    # step that read its row through the stack's dynamic_slice would have the slice
    # fused into its consumers, whose kernels XLA:CPU may then emit in another order
    # than the single step's (measured: jax 0.7.1 on an AVX2 EPYC without AVX-512, the
    # dropout_sgd golden bundle's loss 1 ulp off at step 3, its labels read through the
    # slice inside the loss's reduction; state equal). From the carry, the step's
    # fusions read a plain buffer, as the single step's read a parameter.
    row_of: dict[int, int] = {}  # stacked input index -> carry of its current row
    for i, row in enumerate(inputs):
        if _is_stacked(row):
            name = f"%first{i}"
            lines += _load_row(name, f"%a{i}", new_inputs[i].spec, row.spec, "%zero")
            row_of[i] = len(init)
            init.append(name)
            carry_types.append(_type(row.spec))
    n_carry = len(init)
    block_args = ", ".join(f"%c{c}: {t}" for c, t in enumerate(carry_types))
    all_types = ", ".join(carry_types)

    cond = [
        f'%limit = "stablehlo.constant"() {{value = dense<{k}> : tensor<i64>}} : () -> tensor<i64>',
        '%more = "stablehlo.compare"(%c0, %limit) {comparison_direction = '
        "#stablehlo<comparison_direction LT>} : (tensor<i64>, tensor<i64>) -> tensor<i1>",
        '"stablehlo.return"(%more) : (tensor<i1>) -> ()',
    ]
    body: list[str] = [
        '%z = "stablehlo.constant"() {value = dense<0> : tensor<i64>} : () -> tensor<i64>',
        '%one = "stablehlo.constant"() {value = dense<1> : tensor<i64>} : () -> tensor<i64>',
    ]
    call_args = [f"%c{row_of.get(i, 1 + i)}" for i in range(n_in)]
    in_types = ", ".join(_type(r.spec) for r in inputs)
    out_types = ", ".join(_type(r.spec) for r in outputs)
    body.append(
        f'%res:{len(outputs)} = "func.call"({", ".join(call_args)}) {{callee = @{INNER}}} '
        f": ({in_types}) -> ({out_types})"
    )
    next_carry = [f"%c{c}" for c in range(n_carry)]
    next_carry[0] = "%next"
    body.append('%next = "stablehlo.add"(%c0, %one) : (tensor<i64>, tensor<i64>) -> tensor<i64>')
    # The next iteration's rows; in the last iteration dynamic_slice clamps the start to
    # row k - 1, whose value is not used.
    for i, c in row_of.items():
        body += _load_row(f"%r{i}", f"%c{1 + i}", new_inputs[i].spec, inputs[i].spec, "%z", "%next")
        next_carry[c] = f"%r{i}"
    # Row i - 1 gets the previous iteration's metrics; at i = 0 the index is clamped
    # to row 0, which gets the zero initial value and is overwritten at i = 1.
    body.append(
        '%back = "stablehlo.subtract"(%c0, %one) : (tensor<i64>, tensor<i64>) -> tensor<i64>'
    )
    for j, out in enumerate(outputs):
        c = carry_of_output[j]
        if not isinstance(out, MetricOutput):
            next_carry[c] = f"%res#{j}"
            continue
        body += _store_row(
            f"%u{j}", f"%c{c}", carry_types[c], f"%c{prev_of[j]}", out.spec, "%back", "%z"
        )
        next_carry[c] = f"%u{j}"
        next_carry[prev_of[j]] = f"%res#{j}"
    body.append(f'"stablehlo.return"({", ".join(next_carry)}) : ({all_types}) -> ()')

    def region(ops: list[str]) -> str:
        return f"    ^bb0({block_args}):\n" + "".join(f"      {op}\n" for op in ops)

    lines.append(
        f'%loop:{n_carry} = "stablehlo.while"({", ".join(init)}) ({{\n'
        + region(cond)
        + "    }, {\n"
        + region(body)
        + f"    }}) : ({all_types}) -> ({all_types})"
    )
    returns = [f"%loop#{carry_of_output[j]}" for j in range(len(outputs))]
    if prev_of:  # the last iteration's metrics go into the last row
        lines.append(
            f'%last = "stablehlo.constant"() {{value = dense<{k - 1}> : tensor<i64>}} : () -> '
            "tensor<i64>"
        )
    for j, c in prev_of.items():
        stack = carry_types[carry_of_output[j]]
        lines += _store_row(
            f"%out{j}", returns[j], stack, f"%loop#{c}", outputs[j].spec, "%last", "%zero"
        )
        returns[j] = f"%out{j}"
    return_types = ", ".join(_type(r.spec) for r in new_outputs)
    lines.append(f'"func.return"({", ".join(returns)}) : ({return_types}) -> ()')
    args = ", ".join(f"%a{i}: {_type(r.spec)}" for i, r in enumerate(new_inputs))
    wrapper = (
        "module {\n"
        f"  func.func private @{INNER}({in_types}) -> ({out_types})\n"
        f"  func.func @main({args}) -> ({return_types}) {{\n"
        + "".join(f"    {line}\n" for line in lines)
        + "  }\n}\n"
    )
    module.replace_main(INNER, wrapper)
    return module, replace(
        program,
        inputs=tuple(new_inputs),
        outputs=tuple(new_outputs),
        batch=tuple(NamedSpec(b.name, stacked_spec(b.spec, k)) for b in program.batch),
    )


def _load_row(
    result: str, stack: str, stack_spec: TensorSpec, spec: TensorSpec, zero: str, row: str = ""
) -> list[str]:
    """Ops that read row ``row`` (row 0 when empty) of ``stack`` into ``result`` (of ``spec``)."""
    one = TensorSpec(spec.dtype, (1, *spec.shape))
    starts = ", ".join([row or zero] + [zero] * len(spec.shape))
    start_types = ", ".join(["tensor<i64>"] * (1 + len(spec.shape)))
    s = f"{result}_slice"
    return [
        f'{s} = "stablehlo.dynamic_slice"({stack}, {starts}) '
        f"{{slice_sizes = {_i64_array([1, *spec.shape])}}} : "
        f"({_type(stack_spec)}, {start_types}) -> {_type(one)}",
        f'{result} = "stablehlo.reshape"({s}) : ({_type(one)}) -> {_type(spec)}',
    ]


def _store_row(
    result: str, stack: str, stack_type: str, value: str, spec: TensorSpec, row: str, zero: str
) -> list[str]:
    """Ops that write ``value`` (of ``spec``) into row ``row`` of ``stack``."""
    one = TensorSpec(spec.dtype, (1, *spec.shape))
    starts = ", ".join([row] + [zero] * len(spec.shape))
    start_types = ", ".join(["tensor<i64>"] * (1 + len(spec.shape)))
    r = f"{result}_row"
    return [
        f'{r} = "stablehlo.reshape"({value}) : ({_type(spec)}) -> {_type(one)}',
        f'{result} = "stablehlo.dynamic_update_slice"({stack}, {r}, {starts}) : '
        f"({stack_type}, {_type(one)}, {start_types}) -> {stack_type}",
    ]
