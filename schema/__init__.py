"""stepbundle.schema: the bundle format.

The manifest's dataclasses, the container codec (``write_bundle``, ``open_bundle``), the
version constants and acceptance rule, the one validation function and the typed errors.
``FORMAT.md`` beside this file specifies the format on one page.

Imports: the standard library and msgpack only; never torch, jax or numpy, so that every
side of the project (exporter, runtime, tools in other environments) can depend on it.
"""

from __future__ import annotations

from .codec import (
    ALIGNMENT,
    HEADER_SIZE,
    MAGIC,
    MAX_MANIFEST_BYTES,
    Bundle,
    SectionPayload,
    assemble,
    decode_manifest,
    encode_manifest,
    open_bundle,
    read_manifest,
    write_bundle,
)
from .errors import (
    BundleError,
    BundleFormatError,
    IntegrityError,
    SchemaValidationError,
    UnsupportedVersionError,
)
from .manifest import (
    STATE_INPUT_KINDS,
    BatchInput,
    ConstantInput,
    DType,
    Entry,
    Hyperparameter,
    HyperparameterInput,
    InputBinding,
    InputKind,
    Manifest,
    MetricOutput,
    NamedSpec,
    OutputBinding,
    OutputKind,
    Producer,
    Program,
    Rng,
    RngSeedInput,
    Section,
    SectionKind,
    StateEntry,
    StateInput,
    StateKind,
    StateUpdateOutput,
    TensorSpec,
)
from .validate import validate
from .version import FORMAT_VERSION, KNOWN_FEATURES

__all__ = [
    "ALIGNMENT",
    "BatchInput",
    "Bundle",
    "BundleError",
    "BundleFormatError",
    "ConstantInput",
    "DType",
    "Entry",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "Hyperparameter",
    "HyperparameterInput",
    "InputBinding",
    "InputKind",
    "IntegrityError",
    "KNOWN_FEATURES",
    "MAGIC",
    "MAX_MANIFEST_BYTES",
    "Manifest",
    "MetricOutput",
    "NamedSpec",
    "OutputBinding",
    "OutputKind",
    "Producer",
    "Program",
    "Rng",
    "RngSeedInput",
    "STATE_INPUT_KINDS",
    "SchemaValidationError",
    "Section",
    "SectionKind",
    "SectionPayload",
    "StateEntry",
    "StateInput",
    "StateKind",
    "StateUpdateOutput",
    "TensorSpec",
    "UnsupportedVersionError",
    "assemble",
    "decode_manifest",
    "encode_manifest",
    "open_bundle",
    "read_manifest",
    "validate",
    "write_bundle",
]
