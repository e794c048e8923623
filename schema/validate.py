"""The one validation function of the bundle format.

``validate`` checks every rule that ties manifest fields together, and the layout of the
sections in a file of a given size. The writer calls it before writing a byte and the
reader calls it before handing a manifest to anyone, so a bundle that passes it on one
side passes it on the other. Rules about single values (types, enum members) are enforced
by the codec, which ``validate`` runs first.

All size arithmetic uses Python integers and is compared with the file size before
anything is allocated, so a crafted manifest cannot make a reader allocate more than the
file holds.

Imports: standard library only (and this package).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import SchemaValidationError
from .layout import ALIGNMENT, HEADER_SIZE, align
from .limits import MAX_DIM, MAX_MANIFEST_BYTES, MAX_RANK, MAX_SECTIONS
from .manifest import (
    STATE_INPUT_KINDS,
    BatchInput,
    ConstantInput,
    DType,
    Entry,
    HyperparameterInput,
    Manifest,
    MetricOutput,
    Program,
    RngSeedInput,
    Section,
    SectionKind,
    StateEntry,
    StateInput,
    StateKind,
    StateUpdateOutput,
    TensorSpec,
)
from .records import map_key_path
from .wire import encode_manifest, manifest_to_wire

__all__ = ["PLATFORMS", "validate"]

PLATFORMS: frozenset[str] = frozenset({"cpu", "cuda", "rocm", "tpu"})
"""PJRT platform names a program may list."""

_SHA256_HEX = re.compile(r"[0-9a-f]{64}\Z")
_STABLEHLO_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+\Z")
_SEED_SPEC = TensorSpec(DType.I64, ())


def _fail(path: str, message: str) -> SchemaValidationError:
    return SchemaValidationError(path, message)


def validate(manifest: Manifest, file_size: int, *, manifest_length: int | None = None) -> None:
    """Check ``manifest`` as the manifest of a bundle file of ``file_size`` bytes.

    Args:
      manifest: the manifest to check.
      file_size: the size of the whole file in bytes.
      manifest_length: the byte length of the manifest in the file; by default the length
        of ``encode_manifest(manifest)``. A reader passes the length from the header,
        since a newer writer's manifest may be longer than this reader would encode it.

    Raises:
      SchemaValidationError: the first rule broken, with the path of the offending field.
    """
    manifest_to_wire(manifest)  # every field has the right type (raises with its path)
    if manifest_length is None:
        manifest_length = len(encode_manifest(manifest))
    _check_producer(manifest)
    sections = _check_sections(manifest.sections, file_size, manifest_length)
    states = _check_state(manifest.state, sections)
    _check_hyperparameters(manifest)
    if manifest.rng is not None and not 0 <= manifest.rng.seed < 2**64:
        raise _fail("rng.seed", f"the seed {manifest.rng.seed} is not in [0, 2**64).")
    _check_required_features(manifest.required_features)
    # Built once, not per program: a hostile manifest with many programs and many state
    # entries must cost their sum, not their product.
    tables = _Tables(
        sections=sections,
        states=states,
        hyperparameters={h.name: h.spec for h in manifest.hyperparameters},
        aliases={a: s.name for s in manifest.state for a in s.aliases},
        has_rng=manifest.rng is not None,
    )
    for name, entry in manifest.entries.items():
        _check_entry(name, entry, tables)


def _check_nonempty(value: str, path: str, what: str) -> None:
    if not value:
        raise _fail(path, f"{what} must not be empty.")


def _check_producer(manifest: Manifest) -> None:
    p = manifest.producer
    for field, value in (
        ("stepbundle", p.stepbundle),
        ("torch", p.torch),
        ("torch_xla", p.torch_xla),
        ("jax", p.jax),
    ):
        _check_nonempty(value, f"producer.{field}", "a producer version")


def _check_spec(spec: TensorSpec, path: str) -> None:
    if len(spec.shape) > MAX_RANK:
        raise _fail(
            f"{path}.shape", f"rank {len(spec.shape)} exceeds the limit of {MAX_RANK} dimensions."
        )
    for i, d in enumerate(spec.shape):
        if not 0 <= d <= MAX_DIM:
            raise _fail(f"{path}.shape[{i}]", f"dimension {d} is not in [0, 2**63).")
    if spec.nbytes > MAX_DIM:
        raise _fail(f"{path}.shape", f"the tensor {spec} would take more than 2**63 bytes.")


def _check_sections(
    sections: tuple[Section, ...], file_size: int, manifest_length: int
) -> dict[str, Section]:
    if len(sections) > MAX_SECTIONS:
        raise _fail("sections", f"{len(sections)} sections exceed the limit of {MAX_SECTIONS}.")
    if not 0 <= manifest_length <= MAX_MANIFEST_BYTES:
        raise _fail(
            "",
            f"the manifest is {manifest_length} bytes, more than the limit of "
            f"{MAX_MANIFEST_BYTES} bytes. Keep tensors in sections, not in the manifest.",
        )
    data_start = align(HEADER_SIZE + manifest_length)
    if file_size < data_start:
        raise _fail(
            "sections",
            f"the file has {file_size} bytes, fewer than the {data_start} bytes of its header, "
            "manifest and padding; it is truncated.",
        )
    by_name: dict[str, Section] = {}
    expected = 0  # where the next section must start, relative to the data area
    previous: Section | None = None
    for i, s in enumerate(sections):
        path = f"sections[{i}]"
        _check_nonempty(s.name, f"{path}.name", "a section name")
        if s.name in by_name:
            raise _fail(f"{path}.name", f"the section name {s.name!r} is used twice.")
        by_name[s.name] = s
        if not _SHA256_HEX.match(s.sha256):
            raise _fail(
                f"{path}.sha256",
                f"section {s.name!r}: {s.sha256!r} is not 64 lowercase hex digits.",
            )
        if s.length < 0:
            raise _fail(f"{path}.length", f"section {s.name!r} has negative length {s.length}.")
        if s.offset < 0 or s.offset % ALIGNMENT:
            raise _fail(
                f"{path}.offset",
                f"section {s.name!r} starts at {s.offset}, which is not a non-negative "
                f"multiple of {ALIGNMENT}.",
            )
        after = "the start of the data area" if previous is None else f"section {previous.name!r}"
        if s.offset < expected:
            raise _fail(
                f"{path}.offset",
                f"section {s.name!r} starts at {s.offset}, which overlaps {after} (it ends "
                f"at {expected}); sections must not overlap and must be in file order.",
            )
        if s.offset > expected:
            raise _fail(
                f"{path}.offset",
                f"section {s.name!r} starts at {s.offset}, leaving a gap of "
                f"{s.offset - expected} bytes after {after}; the next section must start "
                f"at {expected}.",
            )
        end = data_start + s.offset + s.length
        if end > file_size:
            raise _fail(
                f"{path}.length",
                f"section {s.name!r} ends at byte {end}, past the end of the {file_size}-byte "
                "file.",
            )
        expected = align(s.offset + s.length)
        previous = s
    end = data_start if previous is None else data_start + previous.offset + previous.length
    if file_size != end:
        raise _fail(
            "sections",
            f"the file has {file_size - end} trailing bytes after the last section (it "
            f"should end at byte {end}).",
        )
    return by_name


def _check_tensor_section(
    sections: Mapping[str, Section], name: str, spec: TensorSpec, path: str, owner: str
) -> None:
    sec = sections.get(name)
    if sec is None:
        raise _fail(path, f"{owner} names section {name!r}, which does not exist.")
    if sec.kind is not SectionKind.TENSOR:
        raise _fail(
            path, f"{owner} names section {name!r}, a {sec.kind.value} section, not tensor."
        )
    if sec.length != spec.nbytes:
        raise _fail(
            path,
            f"{owner} is {spec} ({spec.nbytes} bytes), but section {name!r} has "
            f"{sec.length} bytes.",
        )


def _check_state(
    state: tuple[StateEntry, ...], sections: Mapping[str, Section]
) -> dict[str, StateEntry]:
    by_name: dict[str, StateEntry] = {}
    all_names: dict[str, str] = {}  # every name and alias -> the path that claimed it
    for i, s in enumerate(state):
        path = f"state[{i}]"
        for j, name in enumerate((s.name, *s.aliases)):
            name_path = f"{path}.name" if j == 0 else f"{path}.aliases[{j - 1}]"
            _check_nonempty(name, name_path, "a state name")
            if name in all_names:
                raise _fail(
                    name_path,
                    f"the state name {name!r} is already used by {all_names[name]}; state "
                    "names and aliases must be unique.",
                )
            all_names[name] = path
        _check_spec(s.spec, f"{path}.spec")
        if s.trainable and s.kind is not StateKind.PARAMETER:
            raise _fail(
                f"{path}.trainable",
                f"state {s.name!r} is a {s.kind.value}; only parameters can be trainable.",
            )
        _check_tensor_section(sections, s.section, s.spec, f"{path}.section", f"state {s.name!r}")
        by_name[s.name] = s
    return by_name


def _check_hyperparameters(manifest: Manifest) -> None:
    seen: set[str] = set()
    for i, h in enumerate(manifest.hyperparameters):
        path = f"hyperparameters[{i}]"
        _check_nonempty(h.name, f"{path}.name", "a hyperparameter name")
        if h.name in seen:
            raise _fail(f"{path}.name", f"the hyperparameter name {h.name!r} is used twice.")
        seen.add(h.name)
        _check_spec(h.spec, f"{path}.spec")
        if h.spec.shape != ():
            raise _fail(
                f"{path}.spec.shape",
                f"hyperparameter {h.name!r} must be a scalar, got shape {list(h.spec.shape)}.",
            )


def _check_required_features(features: tuple[str, ...]) -> None:
    seen: set[str] = set()
    for i, f in enumerate(features):
        _check_nonempty(f, f"required_features[{i}]", "a feature name")
        if f in seen:
            raise _fail(f"required_features[{i}]", f"the feature {f!r} is listed twice.")
        seen.add(f)


def _signature(program: Program) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple(sorted((b.name, b.spec.dtype.value, b.spec.shape) for b in program.batch))


@dataclass(frozen=True)
class _Tables:
    """Lookups by name that every program's checks share."""

    sections: Mapping[str, Section]
    states: Mapping[str, StateEntry]
    hyperparameters: Mapping[str, TensorSpec]
    aliases: Mapping[str, str]  # alias -> the state's primary name
    has_rng: bool


def _check_entry(name: str, entry: Entry, tables: _Tables) -> None:
    path = map_key_path("entries", name)
    _check_nonempty(name, "entries", "an entry name")
    if not entry.programs:
        raise _fail(f"{path}.programs", f"entry {name!r} has no program; it needs at least one.")
    signatures: dict[tuple[tuple[str, str, tuple[int, ...]], ...], int] = {}
    for p, program in enumerate(entry.programs):
        ppath = f"{path}.programs[{p}]"
        _check_program(entry, program, ppath, tables)
        sig = _signature(program)
        if sig in signatures:
            raise _fail(
                f"{ppath}.batch",
                f"entry {name!r}: programs {signatures[sig]} and {p} have the same batch "
                "signature, so the runtime could not choose between them.",
            )
        signatures[sig] = p


def _check_program(entry: Entry, program: Program, path: str, tables: _Tables) -> None:
    sections = tables.sections
    sec = sections.get(program.section)
    if sec is None:
        raise _fail(f"{path}.section", f"the program section {program.section!r} does not exist.")
    if sec.kind is not SectionKind.PROGRAM:
        raise _fail(
            f"{path}.section",
            f"section {program.section!r} is a {sec.kind.value} section, not a program.",
        )
    if program.text_section is not None:
        text = sections.get(program.text_section)
        if text is None:
            raise _fail(
                f"{path}.text_section",
                f"the text section {program.text_section!r} does not exist.",
            )
        if text.kind is not SectionKind.TEXT:
            raise _fail(
                f"{path}.text_section",
                f"section {program.text_section!r} is a {text.kind.value} section, not text.",
            )
    if not _STABLEHLO_VERSION.match(program.stablehlo_version):
        raise _fail(
            f"{path}.stablehlo_version",
            f"{program.stablehlo_version!r} is not a version of the form N.N.N.",
        )
    for i, platform in enumerate(program.platforms):
        if platform not in PLATFORMS:
            raise _fail(
                f"{path}.platforms[{i}]",
                f"unknown platform {platform!r}; expected one of {sorted(PLATFORMS)}.",
            )
        if platform in program.platforms[:i]:
            raise _fail(f"{path}.platforms[{i}]", f"the platform {platform!r} is listed twice.")
    batch: dict[str, TensorSpec] = {}
    for i, b in enumerate(program.batch):
        _check_nonempty(b.name, f"{path}.batch[{i}].name", "a batch input name")
        if b.name in batch:
            raise _fail(f"{path}.batch[{i}].name", f"the batch name {b.name!r} is used twice.")
        _check_spec(b.spec, f"{path}.batch[{i}].spec")
        batch[b.name] = b.spec
    _check_inputs(program, path, tables, batch)
    _check_outputs(entry, program, path, tables.states)


def _check_inputs(
    program: Program, path: str, tables: _Tables, batch: Mapping[str, TensorSpec]
) -> None:
    sections, states = tables.sections, tables.states
    hyper, aliases = tables.hyperparameters, tables.aliases
    bound_state: dict[str, int] = {}
    bound_batch: dict[str, int] = {}
    constants: set[str] = set()
    seed_at: int | None = None
    for i, b in enumerate(program.inputs):
        ipath = f"{path}.inputs[{i}]"
        _check_spec(b.spec, f"{ipath}.spec")
        if isinstance(b, StateInput):
            if b.kind not in STATE_INPUT_KINDS:
                raise _fail(f"{ipath}.kind", f"{b.kind.value!r} is not a kind of state.")
            entry = states.get(b.name)
            if entry is None:
                hint = (
                    f" It is an alias of {aliases[b.name]!r}; bind the state under that name."
                    if b.name in aliases
                    else ""
                )
                raise _fail(f"{ipath}.name", f"no state entry is named {b.name!r}.{hint}")
            if b.kind.value != entry.kind.value:
                raise _fail(
                    f"{ipath}.kind",
                    f"input {i} reads state {b.name!r} as {b.kind.value}, but the state is "
                    f"a {entry.kind.value}.",
                )
            _same_spec(b.spec, entry.spec, f"{ipath}.spec", f"state {b.name!r}")
            if b.name in bound_state:
                raise _fail(
                    f"{ipath}.name",
                    f"state {b.name!r} is bound twice, by inputs {bound_state[b.name]} and "
                    f"{i}; each state is bound at most once per program.",
                )
            bound_state[b.name] = i
        elif isinstance(b, BatchInput):
            if b.name not in batch:
                raise _fail(
                    f"{ipath}.name",
                    f"batch input {b.name!r} is not in the program's batch signature.",
                )
            _same_spec(b.spec, batch[b.name], f"{ipath}.spec", f"batch input {b.name!r}")
            if b.name in bound_batch:
                raise _fail(
                    f"{ipath}.name",
                    f"batch input {b.name!r} is bound twice, by inputs {bound_batch[b.name]} "
                    f"and {i}.",
                )
            bound_batch[b.name] = i
        elif isinstance(b, RngSeedInput):
            if seed_at is not None:
                raise _fail(
                    ipath, f"inputs {seed_at} and {i} are both RNG seeds; at most one may be."
                )
            seed_at = i
            _same_spec(b.spec, _SEED_SPEC, f"{ipath}.spec", "the RNG seed")
            if not tables.has_rng:
                raise _fail(ipath, "the program reads an RNG seed, but the manifest's rng is None.")
        elif isinstance(b, HyperparameterInput):
            if b.name not in hyper:
                raise _fail(f"{ipath}.name", f"no hyperparameter is named {b.name!r}.")
            _same_spec(b.spec, hyper[b.name], f"{ipath}.spec", f"hyperparameter {b.name!r}")
        elif isinstance(b, ConstantInput):
            _check_nonempty(b.name, f"{ipath}.name", "a constant name")
            if b.name in constants:
                raise _fail(f"{ipath}.name", f"the constant name {b.name!r} is used twice.")
            constants.add(b.name)
            _check_tensor_section(
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
        _check_spec(o.spec, f"{opath}.spec")
        if isinstance(o, MetricOutput):
            _check_nonempty(o.name, f"{opath}.name", "a metric name")
            if o.name in metrics:
                raise _fail(f"{opath}.name", f"the metric name {o.name!r} is used twice.")
            metrics.add(o.name)
        elif isinstance(o, StateUpdateOutput):
            if not entry.updates_state:
                raise _fail(
                    opath,
                    f"output {j} updates state {o.state!r}, but the entry's updates_state is "
                    "False.",
                )
            target = states.get(o.state)
            if target is None:
                raise _fail(f"{opath}.state", f"no state entry is named {o.state!r}.")
            _same_spec(o.spec, target.spec, f"{opath}.spec", f"state {o.state!r}")
            if o.state in updated:
                raise _fail(
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
        raise _fail(
            f"{opath}.donates",
            f"output {j} donates input {d}, but the program has {len(program.inputs)} inputs.",
        )
    source = program.inputs[d]
    if not isinstance(source, StateInput):
        raise _fail(
            f"{opath}.donates",
            f"output {j} (new value of state {o.state!r}) donates input {d}, which is a "
            f"{source.kind.value} input, not state {o.state!r}.",
        )
    if source.name != o.state:
        raise _fail(
            f"{opath}.donates",
            f"output {j} (new value of state {o.state!r}) donates input {d}, which reads "
            f"state {source.name!r}; it may only donate the input of the same state.",
        )
    _same_spec(source.spec, o.spec, f"{opath}.spec", f"donated input {d}")
    if d in donated:
        raise _fail(
            f"{opath}.donates", f"input {d} is donated twice, to outputs {donated[d]} and {j}."
        )
    donated[d] = j


def _same_spec(actual: TensorSpec, expected: TensorSpec, path: str, what: str) -> None:
    if actual != expected:
        raise _fail(path, f"the spec is {actual}, but {what} is {expected}.")
