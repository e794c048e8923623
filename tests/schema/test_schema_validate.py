"""The cross-field rules of validate(), one broken rule at a time, on the tiny manifest."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from schema_helpers import spec, tiny_manifest, tiny_payloads

from stepbundle.schema import (
    BatchInput,
    ConstantInput,
    DType,
    Entry,
    Hyperparameter,
    InputKind,
    Manifest,
    MetricOutput,
    Rng,
    RngSeedInput,
    SchemaValidationError,
    StateEntry,
    StateInput,
    StateKind,
    StateUpdateOutput,
    TensorSpec,
    validate,
    write_bundle,
)
from stepbundle.schema.wire import encode_manifest
from stepbundle.schema.writer import assemble


def _valid() -> Manifest:
    return assemble(tiny_manifest(), tiny_payloads())


def _size(m: Manifest) -> int:
    last = m.sections[-1]
    data_start = -(-(64 + len(encode_manifest(m))) // 64) * 64
    return data_start + last.offset + last.length


def _program(m: Manifest, **changes: object) -> Manifest:
    program = dataclasses.replace(m.entries["train"].programs[0], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(
        m, entries={"train": dataclasses.replace(m.entries["train"], programs=(program,))}
    )


def _inputs(m: Manifest) -> tuple[object, ...]:
    return m.entries["train"].programs[0].inputs


def _outputs(m: Manifest) -> tuple[object, ...]:
    return m.entries["train"].programs[0].outputs


def test_tiny_manifest_is_valid() -> None:
    m = _valid()
    validate(m, _size(m))
    validate(m, _size(m), manifest_length=len(encode_manifest(m)))


W = spec(DType.F32, 2, 2)

CASES: list[tuple[str, Callable[[Manifest], Manifest], str, str]] = [
    (
        "empty producer",
        lambda m: dataclasses.replace(m, producer=dataclasses.replace(m.producer, torch="")),
        "producer.torch",
        "must not be empty",
    ),
    (
        "bad sha256",
        lambda m: dataclasses.replace(
            m, sections=(dataclasses.replace(m.sections[0], sha256="AB" * 32), m.sections[1])
        ),
        "sections[0].sha256",
        "64 lowercase hex",
    ),
    (
        "duplicate section names",
        lambda m: dataclasses.replace(
            m, sections=(m.sections[0], dataclasses.replace(m.sections[1], name="train.program"))
        ),
        "sections[1].name",
        "used twice",
    ),
    (
        "state section of the wrong length",
        lambda m: dataclasses.replace(
            m, state=(dataclasses.replace(m.state[0], spec=spec(DType.F64, 2, 2)),)
        ),
        "state[0].section",
        "16 bytes",
    ),
    (
        "state section is a program",
        lambda m: dataclasses.replace(
            m, state=(dataclasses.replace(m.state[0], section="train.program"),)
        ),
        "state[0].section",
        "a program section, not tensor",
    ),
    (
        "alias colliding with a name",
        lambda m: dataclasses.replace(m, state=(dataclasses.replace(m.state[0], aliases=("w",)),)),
        "state[0].aliases[0]",
        "already used",
    ),
    (
        "trainable buffer",
        lambda m: dataclasses.replace(
            m, state=(dataclasses.replace(m.state[0], kind=StateKind.BUFFER),)
        ),
        "state[0].trainable",
        "only parameters can be trainable",
    ),
    (
        "negative dimension",
        lambda m: dataclasses.replace(
            m, hyperparameters=(Hyperparameter("lr", spec(DType.F64, -1), 0.1),)
        ),
        "hyperparameters[0].spec.shape[0]",
        "not in [0, 2**63)",
    ),
    (
        "rank above 64",
        lambda m: _program(
            m,
            batch=(
                dataclasses.replace(
                    m.entries["train"].programs[0].batch[0], spec=TensorSpec(DType.F32, (1,) * 65)
                ),
            ),
        ),  # noqa: E501
        "entries.train.programs[0].batch[0].spec.shape",
        "rank 65 exceeds the limit of 64",
    ),
    (
        "non-scalar hyperparameter",
        lambda m: dataclasses.replace(
            m, hyperparameters=(Hyperparameter("lr", spec(DType.F64, 1), 0.1),)
        ),
        "hyperparameters[0].spec.shape",
        "must be a scalar",
    ),
    (
        "seed out of range",
        lambda m: dataclasses.replace(m, rng=Rng(seed=2**64)),
        "rng.seed",
        "does not fit in 64 bits",
    ),
    (
        "negative seed",
        lambda m: dataclasses.replace(m, rng=Rng(seed=-1)),
        "rng.seed",
        "not in [0, 2**64)",
    ),
    (
        "seed advancing after draws without the feature",
        lambda m: dataclasses.replace(m, rng=Rng(seed=1, step_after_draws=2)),
        "rng.step_after_draws",
        "does not list 'rng_restored_draws'",
    ),
    (
        "negative step draws",
        lambda m: dataclasses.replace(m, rng=Rng(seed=1, step_after_draws=-1)),
        "rng.step_after_draws",
        "negative",
    ),
    (
        "negative restored draws",
        lambda m: dataclasses.replace(m, rng=Rng(seed=1, restored_after_draws=(0, -3))),
        "rng.restored_after_draws[1]",
        "negative",
    ),
    (
        "seed without rng",
        lambda m: dataclasses.replace(m, rng=None),
        "entries.train.programs[0].inputs[2]",
        "rng is None",
    ),
    (
        "two seeds",
        lambda m: _program(m, inputs=(*_inputs(m), RngSeedInput(spec(DType.I64)))),
        "entries.train.programs[0].inputs[4]",
        "both RNG seeds",
    ),
    (
        "seed of the wrong spec",
        lambda m: _program(
            m, inputs=(*_inputs(m)[:2], RngSeedInput(spec(DType.I32)), _inputs(m)[3])
        ),  # noqa: E501
        "entries.train.programs[0].inputs[2].spec",
        "i64[]",
    ),
    (
        "state bound twice",
        lambda m: _program(m, inputs=(*_inputs(m), _inputs(m)[0])),
        "entries.train.programs[0].inputs[4].name",
        "bound twice",
    ),
    (
        "state input of the wrong kind",
        lambda m: _program(m, inputs=(StateInput(InputKind.BUFFER, "w", W), *_inputs(m)[1:])),
        "entries.train.programs[0].inputs[0].kind",
        "the state is a parameter",
    ),
    (
        "state input with a non-state kind",
        lambda m: _program(m, inputs=(StateInput(InputKind.BATCH, "w", W), *_inputs(m)[1:])),
        "entries.train.programs[0].inputs[0].kind",
        "not a kind of state",
    ),
    (
        "state input of the wrong spec",
        lambda m: _program(
            m, inputs=(StateInput(InputKind.PARAMETER, "w", spec(DType.F32, 4)), *_inputs(m)[1:])
        ),
        "entries.train.programs[0].inputs[0].spec",
        "f32[4], but state 'w' is f32[2,2]",
    ),
    (
        "batch input outside the signature",
        lambda m: _program(m, inputs=(*_inputs(m), BatchInput("y", spec(DType.F32, 2)))),
        "entries.train.programs[0].inputs[4].name",
        "not in the program's batch signature",
    ),
    (
        "unknown hyperparameter",
        lambda m: dataclasses.replace(m, hyperparameters=()),
        "entries.train.programs[0].inputs[3].name",
        "no hyperparameter is named 'lr'",
    ),
    (
        "constant with a missing section",
        lambda m: _program(m, inputs=(*_inputs(m), ConstantInput("c", W, "nowhere"))),
        "entries.train.programs[0].inputs[4].section",
        "does not exist",
    ),
    (
        "program section missing",
        lambda m: _program(m, section="other"),
        "entries.train.programs[0].section",
        "does not exist",
    ),
    (
        "text section of the wrong kind",
        lambda m: _program(m, text_section="state.w"),
        "entries.train.programs[0].text_section",
        "not text",
    ),
    (
        "bad stablehlo version",
        lambda m: _program(m, stablehlo_version="v1"),
        "entries.train.programs[0].stablehlo_version",
        "N.N.N",
    ),
    (
        "unknown platform",
        lambda m: _program(m, platforms=("metal",)),
        "entries.train.programs[0].platforms[0]",
        "unknown platform 'metal'",
    ),
    (
        "duplicate metric",
        lambda m: _program(m, outputs=(*_outputs(m), MetricOutput("loss", spec(DType.F32)))),
        "entries.train.programs[0].outputs[2].name",
        "used twice",
    ),
    (
        "state updated twice",
        lambda m: _program(m, outputs=(*_outputs(m), StateUpdateOutput("w", W, None))),
        "entries.train.programs[0].outputs[2].state",
        "updated twice",
    ),
    (
        "donation out of range",
        lambda m: _program(m, outputs=(_outputs(m)[0], StateUpdateOutput("w", W, 9))),
        "entries.train.programs[0].outputs[1].donates",
        "has 4 inputs",
    ),
    (
        "donating a batch input",
        lambda m: _program(m, outputs=(_outputs(m)[0], StateUpdateOutput("w", W, 1))),
        "entries.train.programs[0].outputs[1].donates",
        "which is a batch input",
    ),
    (
        "update in a read-only entry",
        lambda m: dataclasses.replace(
            m, entries={"train": dataclasses.replace(m.entries["train"], updates_state=False)}
        ),
        "entries.train.programs[0].outputs[1]",
        "updates_state is False",
    ),
    (
        "entry without programs",
        lambda m: dataclasses.replace(m, entries={"eval": Entry((), False)}),
        "entries.eval.programs",
        "at least one",
    ),
    (
        "same batch signature twice",
        lambda m: dataclasses.replace(
            m, entries={"train": Entry(m.entries["train"].programs * 2, True)}
        ),
        "entries.train.programs[1].batch",
        "same batch signature",
    ),
    (
        "empty entry name",
        lambda m: dataclasses.replace(m, entries={"": m.entries["train"]}),
        "entries",
        "must not be empty",
    ),
    (
        "duplicate required feature",
        lambda m: dataclasses.replace(m, required_features=("a", "a")),
        "required_features[1]",
        "listed twice",
    ),
    (
        "list instead of tuple",
        lambda m: dataclasses.replace(m, state=list(m.state)),  # type: ignore[arg-type]
        "state",
        "expected a tuple, got list",
    ),
    (
        "str instead of enum",
        lambda m: dataclasses.replace(
            m,
            state=(dataclasses.replace(m.state[0], kind="parameter"),),  # type: ignore[arg-type]
        ),
        "state[0].kind",
        "expected a StateKind member",
    ),
    (
        "module named twice in eval_modules",
        lambda m: dataclasses.replace(
            m,
            entries={
                "train": dataclasses.replace(m.entries["train"], eval_modules=("bn", "drop", "bn"))
            },
        ),
        "entries.train.eval_modules",
        "lists module(s) ['bn'] more than once",
    ),
    (
        "bool instead of int",
        lambda m: dataclasses.replace(
            m, sections=(dataclasses.replace(m.sections[0], offset=False), m.sections[1])
        ),
        "sections[0].offset",
        "expected an int, got bool",
    ),
]


@pytest.mark.parametrize(
    ("edit", "path", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rule(edit: Callable[[Manifest], Manifest], path: str, message: str) -> None:
    m = _valid()
    broken = edit(m)
    with pytest.raises(SchemaValidationError) as info:
        validate(broken, _size(m), manifest_length=len(encode_manifest(m)))
    assert info.value.path == path
    assert message in str(info.value)


def test_alias_bound_by_name_gets_a_hint() -> None:
    m = _valid()
    m = dataclasses.replace(m, state=(dataclasses.replace(m.state[0], aliases=("tied",)),))
    m = _program(m, inputs=(StateInput(InputKind.PARAMETER, "tied", W), *_inputs(m)[1:]))
    with pytest.raises(SchemaValidationError, match="alias of 'w'"):
        validate(m, _size(m))


def test_write_bundle_validates_before_writing(tmp_path: Path) -> None:
    m = tiny_manifest()
    b = StateEntry("b", StateKind.BUFFER, W, "state.w", False)
    program = m.entries["train"].programs[0]
    program = dataclasses.replace(
        program,
        inputs=(*program.inputs, StateInput(InputKind.BUFFER, "b", W)),
        outputs=(program.outputs[0], StateUpdateOutput("w", W, donates=4)),
    )
    m = dataclasses.replace(m, state=(*m.state, b), entries={"train": Entry((program,), True)})
    target = tmp_path / "x.sbnd"
    with pytest.raises(SchemaValidationError, match="reads state 'b'") as info:
        write_bundle(target, m, tiny_payloads())
    assert info.value.path == "entries.train.programs[0].outputs[1].donates"
    assert list(tmp_path.iterdir()) == []


def test_size_arithmetic_does_not_allocate() -> None:
    # A tensor of 2**62 elements: checked by arithmetic only, refused by size.
    m = _valid()
    huge = TensorSpec(DType.F64, (2**31, 2**31))
    m = _program(m, outputs=(MetricOutput("loss", huge), _outputs(m)[1]))
    with pytest.raises(SchemaValidationError, match="more than 2\\*\\*63 bytes"):
        validate(m, _size(m))
