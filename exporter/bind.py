"""Turn two consecutive traces of a step into one program's binding tables.

A replayed step is right only if every graph input gets the right value on every call.
State, batch, seed and hyperparameter inputs are fed by the runtime; everything else
(host scalars, temporaries made inside the step) becomes a constant, and only when the
two traces prove it did not change. The graphs themselves must be identical too.

Imports: torch, stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from stepbundle.frontend.dtypes import spec_of, tensor_bytes
from stepbundle.frontend.errors import ExportError
from stepbundle.frontend.tables import STATE_INPUT_KIND, state_update
from stepbundle.schema.manifest import (
    BatchInput,
    ConstantInput,
    HyperparameterInput,
    InputBinding,
    MetricOutput,
    OutputBinding,
    RngSeedInput,
    StateInput,
    StateKind,
    StateUpdateOutput,
)

from .graphdiff import describe_change
from .rng_seeds import prove_seeds
from .trace import InputOrigin, StepTrace

__all__ = ["BoundProgram", "GraphChanged", "bind"]


@dataclass(frozen=True)
class BoundProgram:
    """A program's tables before its sections are named.

    ``constants`` holds the value of each ConstantInput, by the input's name;
    ``eval_modules`` the modules the step ran in eval mode (``Entry.eval_modules``).
    """

    inputs: tuple[InputBinding, ...]
    outputs: tuple[OutputBinding, ...]
    constants: Mapping[str, torch.Tensor]
    bytecode: bytes
    text: str
    eval_modules: tuple[str, ...] = ()
    # A step that restores the RNG state mid-step (exporter/rng_seeds.py): the graph input
    # the kept seed was (of the graph before derived ones were dropped), each derived seed
    # input ``(graph input, K)``, and ``N``, the draws before the step's seed advances.
    seed_input: int | None = None
    derived_seeds: tuple[tuple[int, int], ...] = ()
    step_draws: int | None = None


class GraphChanged(ExportError):
    """The graph of a step differs between its two traces (``graphdiff.py`` says how).

    ``located``: the message names torch_xla's source locations (the traces ran under
    ``xla.ir_debug()``); ``export`` traces again so when it is not.
    """

    def __init__(self, message: str, *, located: bool) -> None:
        super().__init__(message)
        self.located = located


def _fmt(t: torch.Tensor) -> str:
    if t.numel() == 1:
        v = t.detach().cpu().reshape(())
        if v.dtype in (torch.bfloat16, torch.float16):
            v = v.float()
        # numpy prints the shortest text that round-trips at the value's own dtype.
        return str(v.numpy()[()])
    return f"{t.dtype} tensor of shape {tuple(t.shape)} (sum {float(t.double().sum()):.6g})"


def _name_the_value(a: InputOrigin, b: InputOrigin, ta: StepTrace, tb: StepTrace) -> list[str]:
    """Say which optimizer setting a changing host scalar is, when it is one."""
    if a.value is None or b.value is None or a.value.numel() != 1:
        return []
    va, vb = float(a.value.double().item()), float(b.value.double().item())
    after = dict(tb.hyper_values)
    for label, xa in ta.hyper_values:
        xb = after.get(label)
        if xb is None or xa == xb:
            continue
        if any(_close(va, s * xa) and _close(vb, s * xb) for s in (1.0, -1.0)):
            key, tail = label.split("'")[1], label.split("'")[-1]
            if tail.startswith("]["):  # an element of a tuple setting: betas.0
                key = f"{key}.{tail[2:-1]}"
            return [
                f"It is the optimizer's {label}, which changed from {xa!r} to {xb!r} between "
                "the steps (a learning-rate scheduler, or other code that edits "
                f"param_groups). Declare it: Recipe(hyperparameters=({key!r},)), and set "
                "it from the runtime (trainer.set_hyperparameter, or stepbundle run "
                "--lr-schedule) instead of inside the step."
            ]
    return []


def _close(x: float, y: float) -> bool:
    return abs(x - y) <= 1e-6 * max(1.0, abs(x), abs(y))


def bind(
    ta: StepTrace,
    tb: StepTrace,
    *,
    what: str,
    state_kinds: Mapping[str, StateKind],
    hints: list[str],
    constant_prefix: str,
) -> BoundProgram:
    """Compare two traces of the same step and build the program's tables.

    Raises ExportError when the graphs differ, when an input changes its origin, or
    when a would-be constant differs between the two steps.
    """
    hint_text = "".join(f"\n  - {h}" for h in hints)
    if ta.text != tb.text:
        raise GraphChanged(
            f"The graph of the {what} changed between two consecutive traced steps, so "
            "no single program can replay it. This happens with Python control flow on "
            "step-dependent values (a step counter, a value read from a tensor), or when "
            "a Python number flips between values torch_xla inlines (0 or 1) and others. "
            f"What changed:{describe_change(ta, tb)}"
            + (f"\nLikely causes:{hint_text}" if hints else ""),
            located=bool(ta.ir and tb.ir),
        )
    if len(ta.inputs) != len(tb.inputs):  # pragma: no cover - implied by equal text
        raise ExportError(f"The {what} has a different number of graph inputs in each traced step.")
    if ta.metric_names != tb.metric_names or ta.updated_state != tb.updated_state:
        raise ExportError(
            f"The {what} returned different metrics or updated different state in two "
            f"consecutive steps (metrics {list(ta.metric_names)} then {list(tb.metric_names)}; "
            f"updated {len(ta.updated_state)} then {len(tb.updated_state)} state tensors). "
            "A step must do the same work every time."
        )
    seeds = [i for i, a in enumerate(ta.inputs) if a.kind == "rng_seed"]
    proof = (
        prove_seeds(seeds, _seed_values(ta, seeds), _seed_values(tb, seeds), what)
        if seeds
        else None
    )
    inputs: list[InputBinding] = []
    constants: dict[str, torch.Tensor] = {}
    state_input_index: dict[str, int] = {}
    for i, (a, b) in enumerate(zip(ta.inputs, tb.inputs)):
        spec = spec_of(a.dtype, a.shape, f"Graph input {i} of the {what}")
        if a.kind != b.kind or a.name != b.name:
            raise ExportError(
                f"Graph input {i} of the {what} is {a.kind} {a.name!r} in one traced step and "
                f"{b.kind} {b.name!r} in the next. The step must read the same tensors in "
                "the same way every time."
            )
        if a.kind == "state":
            state_input_index[a.name] = i
            inputs.append(StateInput(STATE_INPUT_KIND[state_kinds[a.name]], a.name, spec))
        elif a.kind == "batch":
            inputs.append(BatchInput(a.name, spec))
        elif a.kind == "hyperparameter":
            inputs.append(HyperparameterInput(a.name, spec))
        elif a.kind == "rng_seed":
            inputs.append(RngSeedInput(spec))
        else:
            assert a.value is not None and b.value is not None
            if a.value.shape != b.value.shape or tensor_bytes(a.value) != tensor_bytes(b.value):
                named = _name_the_value(a, b, ta, tb)
                more = "".join(f"\n  - {h}" for h in (named or hints))
                raise ExportError(
                    f"Graph input {i} of the {what} is a value captured from Python or made "
                    f"inside the step ({spec}), and it changed between two consecutive traced "
                    f"steps: {_fmt(a.value)} in step 1, {_fmt(b.value)} in step 2. A bundle "
                    "would freeze it at one value, so the export is refused."
                    + (
                        f"\nWhat it is and how to fix it:{more}"
                        if more
                        else "\nMake it a tensor the step reads from the model, the optimizer "
                        "state or the batch, or declare it as a hyperparameter."
                    )
                )
            name = f"{constant_prefix}{len(constants)}"
            constants[name] = b.value
            inputs.append(ConstantInput(name, spec, section=name))
    outputs: list[OutputBinding] = []
    for name, (dt, shape) in zip(tb.metric_names, tb.metric_specs):
        outputs.append(MetricOutput(name, spec_of(dt, shape, f"Metric {name!r}")))
    for name, (dt, shape) in zip(tb.updated_state, tb.update_specs):
        spec = spec_of(dt, shape, f"State {name!r}")
        donates = state_input_index.get(name)
        before = None if donates is None else inputs[donates].spec
        outputs.append(state_update(name, spec, before, donates, what))
    if ta.eval_modules != tb.eval_modules:
        raise ExportError(
            f"The {what} left different modules in eval mode in two consecutive traced steps "
            f"({list(ta.eval_modules)[:5]} then {list(tb.eval_modules)[:5]}). Set the modes "
            "the same way every step (model.train(), then .eval() on the frozen modules)."
        )
    derived = proof.derived if proof is not None else ()
    if derived:
        # The program keeps one seed input; the derived ones are computed from it
        # (rng_seeds.derive_seeds), so later inputs move up.
        gone = {i for i, _ in derived}
        new_index: dict[int, int] = {}
        for i in range(len(inputs)):
            if i not in gone:
                new_index[i] = len(new_index)
        inputs = [b for i, b in enumerate(inputs) if i not in gone]
        outputs = [
            replace(o, donates=new_index[o.donates])
            if isinstance(o, StateUpdateOutput) and o.donates is not None
            else o
            for o in outputs
        ]
    return BoundProgram(
        tuple(inputs),
        tuple(outputs),
        constants,
        tb.bytecode,
        tb.text,
        tb.eval_modules,
        seed_input=proof.base if derived and proof is not None else None,
        derived_seeds=derived,
        step_draws=proof.step_draws if proof is not None else None,
    )


def _seed_values(t: StepTrace, positions: list[int]) -> list[int]:
    """The seeds torch_xla fed a traced step at ``positions``, as unsigned 64-bit ints."""
    out = []
    for i in positions:
        v = t.inputs[i].value
        assert v is not None
        out.append(int(v.reshape(()).item()) % 2**64)
    return out
