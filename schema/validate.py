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

import math
import re
from collections.abc import Mapping

from .layout import ALIGNMENT, HEADER_SIZE, align
from .limits import MAX_MANIFEST_BYTES, MAX_SECTIONS
from .manifest import (
    DType,
    Manifest,
    Rng,
    Section,
    SectionKind,
    StateEntry,
    StateKind,
)
from .validate_programs import (
    PLATFORMS,
    Tables,
    check_entry,
    check_nonempty,
    check_spec,
    check_tensor_section,
    fail,
)
from .version import (
    FORMAT_VERSION,
    MATMUL_PRECISIONS,
    NUMERICS,
    RNG_RESTORED_DRAWS,
    STATE_INITIALIZERS,
)
from .wire import encode_manifest, manifest_to_wire

__all__ = ["PLATFORMS", "validate"]


_SHA256_HEX = re.compile(r"[0-9a-f]{64}\Z")


def _check_numerics(numerics: str | None, format_version: tuple[int, int]) -> None:
    """``numerics`` is one of ``version.NUMERICS`` (every value a writer has written:
    ``pytorch``, ``torch_xla``) in a bundle of this reader's version or older. A newer
    minor may add values, and a reader that refused one would refuse a bundle it runs
    correctly (a value readers must act on would come with a required feature): there
    any non-empty value is accepted. Until issue #43 any non-empty value was accepted
    everywhere, ``"yolo"`` included."""
    if numerics is None:
        return
    check_nonempty(numerics, "numerics", "numerics")
    if format_version <= FORMAT_VERSION and numerics not in NUMERICS:
        raise fail(
            "numerics",
            f"{numerics!r} is not one of {', '.join(sorted(NUMERICS))}, the values format "
            f"{format_version[0]}.{format_version[1]} allows. The bundle was not written by "
            "a stepbundle exporter, or its manifest was edited: export it again.",
        )


def validate(
    manifest: Manifest,
    file_size: int,
    *,
    manifest_length: int | None = None,
    format_version: tuple[int, int] = FORMAT_VERSION,
) -> None:
    """Check ``manifest`` as the manifest of a bundle file of ``file_size`` bytes.

    Args:
      manifest: the manifest to check.
      file_size: the size of the whole file in bytes.
      manifest_length: the byte length of the manifest in the file; by default the length
        of ``encode_manifest(manifest)``. A reader passes the length from the header,
        since a newer writer's manifest may be longer than this reader would encode it.
      format_version: the version in the file's header (a reader passes it); by default
        this writer's. Some fields take only the values of the versions this reader
        knows, and any value from a newer minor (``numerics``).

    Raises:
      SchemaValidationError: the first rule broken, with the path of the offending field.
    """
    manifest_to_wire(manifest)  # every field has the right type (raises with its path)
    if manifest_length is None:
        manifest_length = len(encode_manifest(manifest))
    _check_producer(manifest)
    sections = _check_sections(manifest.sections, file_size, manifest_length)
    states = _check_state(manifest.state, sections, manifest.required_features)
    _check_hyperparameters(manifest)
    if manifest.rng is not None and not 0 <= manifest.rng.seed < 2**64:
        raise fail("rng.seed", f"the seed {manifest.rng.seed} is not in [0, 2**64).")
    if manifest.rng is not None:
        _check_rng_draws(manifest.rng, manifest.required_features)
    _check_required_features(manifest.required_features)
    for key in manifest.metadata:
        check_nonempty(key, "metadata", "a metadata key")
    _check_numerics(manifest.numerics, format_version)
    # Unlike numerics, the runtime acts on it: an unknown value is refused.
    if manifest.matmul_precision not in MATMUL_PRECISIONS:
        raise fail(
            "matmul_precision",
            f"{manifest.matmul_precision!r} is not one of {', '.join(MATMUL_PRECISIONS)}.",
        )
    # Built once, not per program: a hostile manifest with many programs and many state
    # entries must cost their sum, not their product.
    tables = Tables(
        sections=sections,
        states=states,
        hyperparameters={h.name: h.spec for h in manifest.hyperparameters},
        aliases={a: s.name for s in manifest.state for a in s.aliases},
        has_rng=manifest.rng is not None,
    )
    for name, entry in manifest.entries.items():
        check_entry(name, entry, tables)


def _check_producer(manifest: Manifest) -> None:
    p = manifest.producer
    for field, value in (
        ("stepbundle", p.stepbundle),
        ("torch", p.torch),
        ("torch_xla", p.torch_xla),
        ("jax", p.jax),
    ):
        check_nonempty(value, f"producer.{field}", "a producer version")


def _check_sections(
    sections: tuple[Section, ...], file_size: int, manifest_length: int
) -> dict[str, Section]:
    if len(sections) > MAX_SECTIONS:
        raise fail("sections", f"{len(sections)} sections exceed the limit of {MAX_SECTIONS}.")
    if not 0 <= manifest_length <= MAX_MANIFEST_BYTES:
        raise fail(
            "",
            f"the manifest is {manifest_length} bytes, more than the limit of "
            f"{MAX_MANIFEST_BYTES} bytes. Keep tensors in sections, not in the manifest.",
        )
    data_start = align(HEADER_SIZE + manifest_length)
    if file_size < data_start:
        raise fail(
            "sections",
            f"the file has {file_size} bytes, fewer than the {data_start} bytes of its header, "
            "manifest and padding; it is truncated.",
        )
    by_name: dict[str, Section] = {}
    expected = 0  # where the next section must start, relative to the data area
    previous: Section | None = None
    for i, s in enumerate(sections):
        path = f"sections[{i}]"
        check_nonempty(s.name, f"{path}.name", "a section name")
        if s.name in by_name:
            raise fail(f"{path}.name", f"the section name {s.name!r} is used twice.")
        by_name[s.name] = s
        if not _SHA256_HEX.match(s.sha256):
            raise fail(
                f"{path}.sha256",
                f"section {s.name!r}: {s.sha256!r} is not 64 lowercase hex digits.",
            )
        if s.length < 0:
            raise fail(f"{path}.length", f"section {s.name!r} has negative length {s.length}.")
        if s.offset < 0 or s.offset % ALIGNMENT:
            raise fail(
                f"{path}.offset",
                f"section {s.name!r} starts at {s.offset}, which is not a non-negative "
                f"multiple of {ALIGNMENT}.",
            )
        after = "the start of the data area" if previous is None else f"section {previous.name!r}"
        if s.offset < expected:
            raise fail(
                f"{path}.offset",
                f"section {s.name!r} starts at {s.offset}, which overlaps {after} (it ends "
                f"at {expected}); sections must not overlap and must be in file order.",
            )
        if s.offset > expected:
            raise fail(
                f"{path}.offset",
                f"section {s.name!r} starts at {s.offset}, leaving a gap of "
                f"{s.offset - expected} bytes after {after}; the next section must start "
                f"at {expected}.",
            )
        end = data_start + s.offset + s.length
        if end > file_size:
            raise fail(
                f"{path}.length",
                f"section {s.name!r} ends at byte {end}, past the end of the {file_size}-byte "
                "file.",
            )
        expected = align(s.offset + s.length)
        previous = s
    end = data_start if previous is None else data_start + previous.offset + previous.length
    if file_size != end:
        raise fail(
            "sections",
            f"the file has {file_size - end} trailing bytes after the last section (it "
            f"should end at byte {end}).",
        )
    return by_name


def _check_state(
    state: tuple[StateEntry, ...], sections: Mapping[str, Section], features: tuple[str, ...]
) -> dict[str, StateEntry]:
    by_name: dict[str, StateEntry] = {}
    all_names: dict[str, str] = {}  # every name and alias -> the path that claimed it
    for i, s in enumerate(state):
        path = f"state[{i}]"
        for j, name in enumerate((s.name, *s.aliases)):
            name_path = f"{path}.name" if j == 0 else f"{path}.aliases[{j - 1}]"
            check_nonempty(name, name_path, "a state name")
            if name in all_names:
                raise fail(
                    name_path,
                    f"the state name {name!r} is already used by {all_names[name]}; state "
                    "names and aliases must be unique.",
                )
            all_names[name] = path
        check_spec(s.spec, f"{path}.spec")
        if s.trainable and s.kind is not StateKind.PARAMETER:
            raise fail(
                f"{path}.trainable",
                f"state {s.name!r} is a {s.kind.value}; only parameters can be trainable.",
            )
        _check_state_section(sections, s, f"{path}.section", features)
        by_name[s.name] = s
    return by_name


def _check_state_section(
    sections: Mapping[str, Section], s: StateEntry, path: str, features: tuple[str, ...]
) -> None:
    """A state's section holds its value (``tensor``), one element of it (``fill``) or
    nothing (``external``); the last two need the ``state_initializers`` feature."""
    sec = sections.get(s.section)
    if sec is None or sec.kind not in (SectionKind.FILL, SectionKind.EXTERNAL):
        check_tensor_section(sections, s.section, s.spec, path, f"state {s.name!r}")
        return
    if STATE_INITIALIZERS not in features:
        raise fail(
            path,
            f"state {s.name!r} names the {sec.kind.value} section {s.section!r}, but "
            f"required_features does not list {STATE_INITIALIZERS!r}; a reader that does not "
            "know the feature would find no stored value. List it.",
        )
    want = s.spec.dtype.itemsize if sec.kind is SectionKind.FILL else 0
    if sec.length != want:
        what = f"one element ({want} bytes)" if sec.kind is SectionKind.FILL else "no bytes"
        raise fail(
            path,
            f"state {s.name!r} is {s.spec}, so its {sec.kind.value} section {s.section!r} "
            f"holds {what}, but it has {sec.length} bytes.",
        )


# The largest finite value of each floating dtype narrower than float64.
_FLOAT_MAX = {
    DType.F32: 3.4028234663852886e38,
    DType.BF16: 3.3895313892515355e38,
    DType.F16: 65504.0,
}


def _check_hyperparameters(manifest: Manifest) -> None:
    seen: set[str] = set()
    for i, h in enumerate(manifest.hyperparameters):
        path = f"hyperparameters[{i}]"
        check_nonempty(h.name, f"{path}.name", "a hyperparameter name")
        if h.name in seen:
            raise fail(f"{path}.name", f"the hyperparameter name {h.name!r} is used twice.")
        seen.add(h.name)
        check_spec(h.spec, f"{path}.spec")
        if h.spec.shape != ():
            raise fail(
                f"{path}.spec.shape",
                f"hyperparameter {h.name!r} must be a scalar, got shape {list(h.spec.shape)}.",
            )
        if not math.isfinite(h.value):
            raise fail(
                f"{path}.value",
                f"hyperparameter {h.name!r} has the value {h.value!r}; a hyperparameter must be "
                "finite (a NaN or infinite lr would turn the whole state into NaN).",
            )
        largest = _FLOAT_MAX.get(h.spec.dtype)
        if largest is not None and abs(h.value) > largest:
            raise fail(
                f"{path}.value",
                f"hyperparameter {h.name!r} has the value {h.value!r}, which is infinite as "
                f"{h.spec.dtype.value} (largest {largest!r}).",
            )


def _check_rng_draws(rng: Rng, features: tuple[str, ...]) -> None:
    for i, k in enumerate(rng.restored_after_draws):
        if k < 0:
            raise fail(f"rng.restored_after_draws[{i}]", f"{k} draws is negative.")
    if rng.step_after_draws < 0:
        raise fail("rng.step_after_draws", f"{rng.step_after_draws} is negative.")
    if rng.step_after_draws and RNG_RESTORED_DRAWS not in features:
        raise fail(
            "rng.step_after_draws",
            f"the seed advances after {rng.step_after_draws} draws, but required_features "
            f"does not list {RNG_RESTORED_DRAWS!r}; a reader that does not know it would "
            "feed the wrong seeds.",
        )


def _check_required_features(features: tuple[str, ...]) -> None:
    seen: set[str] = set()
    for i, f in enumerate(features):
        check_nonempty(f, f"required_features[{i}]", "a feature name")
        if f in seen:
            raise fail(f"required_features[{i}]", f"the feature {f!r} is listed twice.")
        seen.add(f)
