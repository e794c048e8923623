"""Validation of each entry's programs: binding tables, output tables and donation.

``validate`` (in ``validate.py``) checks the manifest as a whole and calls ``check_entry``
for each entry with the lookups it built once (``Tables``). The small checks both
modules share (``fail``, ``check_nonempty``, ``check_spec``) live here, below ``validate``.

Imports: standard library only (and this package).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import SchemaValidationError
from .limits import MAX_DIM, MAX_RANK
from .manifest import (
    STATE_INPUT_KINDS,
    BatchInput,
    ConstantInput,
    DType,
    Entry,
    HyperparameterInput,
    MetricOutput,
    Program,
    RngSeedInput,
    Section,
    SectionKind,
    StateEntry,
    StateInput,
    StateUpdateOutput,
    TensorSpec,
)
from .records import map_key_path

__all__ = [
    "PLATFORMS",
    "Tables",
    "check_entry",
    "check_nonempty",
    "check_spec",
    "check_tensor_section",
    "fail",
]

PLATFORMS: frozenset[str] = frozenset({"cpu", "cuda", "rocm", "tpu"})
"""PJRT platform names a program may list."""

_STABLEHLO_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+\Z")
_SEED_SPEC = TensorSpec(DType.I64, ())


def fail(path: str, message: str) -> SchemaValidationError:
    return SchemaValidationError(path, message)


def check_nonempty(value: str, path: str, what: str) -> None:
    if not value:
        raise fail(path, f"{what} must not be empty.")


def check_spec(spec: TensorSpec, path: str) -> None:
    if len(spec.shape) > MAX_RANK:
        raise fail(
            f"{path}.shape", f"rank {len(spec.shape)} exceeds the limit of {MAX_RANK} dimensions."
        )
    for i, d in enumerate(spec.shape):
        if not 0 <= d <= MAX_DIM:
            raise fail(f"{path}.shape[{i}]", f"dimension {d} is not in [0, 2**63).")
    if spec.nbytes > MAX_DIM:
        raise fail(f"{path}.shape", f"the tensor {spec} would take more than 2**63 bytes.")


def check_tensor_section(
    sections: Mapping[str, Section], name: str, spec: TensorSpec, path: str, owner: str
) -> None:
    sec = sections.get(name)
    if sec is None:
        raise fail(path, f"{owner} names section {name!r}, which does not exist.")
    if sec.kind is not SectionKind.TENSOR:
        raise fail(path, f"{owner} names section {name!r}, a {sec.kind.value} section, not tensor.")
    if sec.length != spec.nbytes:
        raise fail(
            path,
            f"{owner} is {spec} ({spec.nbytes} bytes), but section {name!r} has "
            f"{sec.length} bytes.",
        )


def _signature(program: Program) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple(sorted((b.name, b.spec.dtype.value, b.spec.shape) for b in program.batch))


@dataclass(frozen=True)
class Tables:
    """Lookups by name that every program's checks share."""

    sections: Mapping[str, Section]
    states: Mapping[str, StateEntry]
    hyperparameters: Mapping[str, TensorSpec]
    aliases: Mapping[str, str]  # alias -> the state's primary name
    has_rng: bool


def check_entry(name: str, entry: Entry, tables: Tables) -> None:
    path = map_key_path("entries", name)
    check_nonempty(name, "entries", "an entry name")
    if not entry.programs:
        raise fail(f"{path}.programs", f"entry {name!r} has no program; it needs at least one.")
    if len(set(entry.eval_modules)) != len(entry.eval_modules):
        twice = sorted({m for m in entry.eval_modules if entry.eval_modules.count(m) > 1})
        raise fail(
            f"{path}.eval_modules",
            f"entry {name!r} lists module(s) {twice} more than once; names must be unique.",
        )
    signatures: dict[tuple[tuple[str, str, tuple[int, ...]], ...], int] = {}
    for p, program in enumerate(entry.programs):
        ppath = f"{path}.programs[{p}]"
        _check_program(entry, program, ppath, tables)
        sig = _signature(program)
        if sig in signatures:
            raise fail(
                f"{ppath}.batch",
                f"entry {name!r}: programs {signatures[sig]} and {p} have the same batch "
                "signature, so the runtime could not choose between them.",
            )
        signatures[sig] = p


def _check_program(entry: Entry, program: Program, path: str, tables: Tables) -> None:
    sections = tables.sections
    sec = sections.get(program.section)
    if sec is None:
        raise fail(f"{path}.section", f"the program section {program.section!r} does not exist.")
    if sec.kind is not SectionKind.PROGRAM:
        raise fail(
            f"{path}.section",
            f"section {program.section!r} is a {sec.kind.value} section, not a program.",
        )
    if program.text_section is not None:
        text = sections.get(program.text_section)
        if text is None:
            raise fail(
                f"{path}.text_section",
                f"the text section {program.text_section!r} does not exist.",
            )
        if text.kind is not SectionKind.TEXT:
            raise fail(
                f"{path}.text_section",
                f"section {program.text_section!r} is a {text.kind.value} section, not text.",
            )
    if not _STABLEHLO_VERSION.match(program.stablehlo_version):
        raise fail(
            f"{path}.stablehlo_version",
            f"{program.stablehlo_version!r} is not a version of the form N.N.N.",
        )
    for i, platform in enumerate(program.platforms):
        if platform not in PLATFORMS:
            raise fail(
                f"{path}.platforms[{i}]",
                f"unknown platform {platform!r}; expected one of {sorted(PLATFORMS)}.",
            )
        if platform in program.platforms[:i]:
            raise fail(f"{path}.platforms[{i}]", f"the platform {platform!r} is listed twice.")
    batch: dict[str, TensorSpec] = {}
    for i, b in enumerate(program.batch):
        check_nonempty(b.name, f"{path}.batch[{i}].name", "a batch input name")
        if b.name in batch:
            raise fail(f"{path}.batch[{i}].name", f"the batch name {b.name!r} is used twice.")
        check_spec(b.spec, f"{path}.batch[{i}].spec")
        batch[b.name] = b.spec
    _check_inputs(program, path, tables, batch)
    _check_outputs(entry, program, path, tables.states)


def _check_inputs(
    program: Program, path: str, tables: Tables, batch: Mapping[str, TensorSpec]
) -> None:
    sections, states = tables.sections, tables.states
    hyper, aliases = tables.hyperparameters, tables.aliases
    bound_state: dict[str, int] = {}
    bound_batch: dict[str, int] = {}
    constants: set[str] = set()
    seed_at: int | None = None
    for i, b in enumerate(program.inputs):
        ipath = f"{path}.inputs[{i}]"
        check_spec(b.spec, f"{ipath}.spec")
        if isinstance(b, StateInput):
            if b.kind not in STATE_INPUT_KINDS:
                raise fail(f"{ipath}.kind", f"{b.kind.value!r} is not a kind of state.")
            entry = states.get(b.name)
            if entry is None:
                hint = (
                    f" It is an alias of {aliases[b.name]!r}; bind the state under that name."
                    if b.name in aliases
                    else ""
                )
                raise fail(f"{ipath}.name", f"no state entry is named {b.name!r}.{hint}")
            if b.kind.value != entry.kind.value:
                raise fail(
                    f"{ipath}.kind",
                    f"input {i} reads state {b.name!r} as {b.kind.value}, but the state is "
                    f"a {entry.kind.value}.",
                )
            _same_spec(b.spec, entry.spec, f"{ipath}.spec", f"state {b.name!r}")
            if b.name in bound_state:
                raise fail(
                    f"{ipath}.name",
                    f"state {b.name!r} is bound twice, by inputs {bound_state[b.name]} and "
                    f"{i}; each state is bound at most once per program.",
                )
            bound_state[b.name] = i
        elif isinstance(b, BatchInput):
            if b.name not in batch:
                raise fail(
                    f"{ipath}.name",
                    f"batch input {b.name!r} is not in the program's batch signature.",
                )
            _same_spec(b.spec, batch[b.name], f"{ipath}.spec", f"batch input {b.name!r}")
            if b.name in bound_batch:
                raise fail(
                    f"{ipath}.name",
                    f"batch input {b.name!r} is bound twice, by inputs {bound_batch[b.name]} "
                    f"and {i}.",
                )
            bound_batch[b.name] = i
        elif isinstance(b, RngSeedInput):
            if seed_at is not None:
                raise fail(
                    ipath, f"inputs {seed_at} and {i} are both RNG seeds; at most one may be."
                )
            seed_at = i
            _same_spec(b.spec, _SEED_SPEC, f"{ipath}.spec", "the RNG seed")
            if not tables.has_rng:
                raise fail(ipath, "the program reads an RNG seed, but the manifest's rng is None.")
        elif isinstance(b, HyperparameterInput):
            if b.name not in hyper:
                raise fail(f"{ipath}.name", f"no hyperparameter is named {b.name!r}.")
            _same_spec(b.spec, hyper[b.name], f"{ipath}.spec", f"hyperparameter {b.name!r}")
        elif isinstance(b, ConstantInput):
            check_nonempty(b.name, f"{ipath}.name", "a constant name")
            if b.name in constants:
                raise fail(f"{ipath}.name", f"the constant name {b.name!r} is used twice.")
            constants.add(b.name)
            check_tensor_section(
                sections, b.section, b.spec, f"{ipath}.section", f"constant {b.name!r}"
            )


def _check_outputs(
    entry: Entry, program: Program, path: str, states: Mapping[str, StateEntry]
) -> None:
    metrics: set[str] = set()
    updated: dict[str, int] = {}
    donated: dict[int, int] = {}
    for j, o in enumerate(program.outputs):
        opath = f"{path}.outputs[{j}]"
        check_spec(o.spec, f"{opath}.spec")
        if isinstance(o, MetricOutput):
            check_nonempty(o.name, f"{opath}.name", "a metric name")
            if o.name in metrics:
                raise fail(f"{opath}.name", f"the metric name {o.name!r} is used twice.")
            metrics.add(o.name)
        elif isinstance(o, StateUpdateOutput):
            if not entry.updates_state:
                raise fail(
                    opath,
                    f"output {j} updates state {o.state!r}, but the entry's updates_state is "
                    "False.",
                )
            target = states.get(o.state)
            if target is None:
                raise fail(f"{opath}.state", f"no state entry is named {o.state!r}.")
            _same_spec(o.spec, target.spec, f"{opath}.spec", f"state {o.state!r}")
            if o.state in updated:
                raise fail(
                    f"{opath}.state",
                    f"state {o.state!r} is updated twice, by outputs {updated[o.state]} and {j}.",
                )
            updated[o.state] = j
            if o.donates is not None:
                _check_donation(program, o, j, opath, donated)


def _check_donation(
    program: Program, o: StateUpdateOutput, j: int, opath: str, donated: dict[int, int]
) -> None:
    d = o.donates
    assert d is not None
    if not 0 <= d < len(program.inputs):
        raise fail(
            f"{opath}.donates",
            f"output {j} donates input {d}, but the program has {len(program.inputs)} inputs.",
        )
    source = program.inputs[d]
    if not isinstance(source, StateInput):
        raise fail(
            f"{opath}.donates",
            f"output {j} (new value of state {o.state!r}) donates input {d}, which is a "
            f"{source.kind.value} input, not state {o.state!r}.",
        )
    if source.name != o.state:
        raise fail(
            f"{opath}.donates",
            f"output {j} (new value of state {o.state!r}) donates input {d}, which reads "
            f"state {source.name!r}; it may only donate the input of the same state.",
        )
    _same_spec(source.spec, o.spec, f"{opath}.spec", f"donated input {d}")
    if d in donated:
        raise fail(
            f"{opath}.donates", f"input {d} is donated twice, to outputs {donated[d]} and {j}."
        )
    donated[d] = j


def _same_spec(actual: TensorSpec, expected: TensorSpec, path: str, what: str) -> None:
    if actual != expected:
        raise fail(path, f"the spec is {actual}, but {what} is {expected}.")
