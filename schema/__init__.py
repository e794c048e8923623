"""stepbundle.schema: the bundle format.

The manifest's dataclasses (``manifest.py``, with its tensor types in ``tensors.py`` and
the binding-table rows in ``bindings.py``), their wire form (``records.py``,
``wire.py``), the file layout and size limits (``layout.py``, ``limits.py``), the one
validation function (``validate.py``, with the per-program table checks in
``validate_programs.py``), the writer and the reader (``writer.py``,
``reader.py``), the version constants and acceptance rule (``version.py``), the seed rule
(``rng.py``), the project's one atomic file write (``atomic.py``), the schema's description and its
version lock (``describe.py``, ``lock.py``) and the typed errors.
``FORMAT.md`` beside this file specifies the format on one page.

Modules import each other in one direction only, never in a cycle: errors, limits,
version, tensors <- bindings <- manifest, atomic, rng <- layout, records <- wire,
validate_programs <- validate <- writer, reader; lock reads version; describe reads
layout, limits, lock, records and wire.

Imports: the standard library and msgpack only; never torch, jax or numpy, so that every
side of the project (exporter, runtime, tools in other environments) can depend on it.
"""

from __future__ import annotations

from .atomic import atomic_write
from .errors import (
    BundleError,
    BundleFormatError,
    IntegrityError,
    SchemaValidationError,
    UnsupportedVersionError,
)
from .layout import ALIGNMENT, HEADER_SIZE, MAGIC
from .limits import MAX_MANIFEST_BYTES
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
from .reader import Bundle, open_bundle, read_manifest
from .rng import UnknownSeedRuleError, advance_seed, draw_seed
from .validate import validate
from .version import (
    FORMAT_VERSION,
    KNOWN_FEATURES,
    MATMUL_PRECISIONS,
    NUMERICS,
    STATE_INITIALIZERS,
)
from .wire import decode_manifest, encode_manifest
from .writer import SectionPayload, assemble, write_bundle

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
    "MATMUL_PRECISIONS",
    "NUMERICS",
    "STATE_INITIALIZERS",
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
    "UnknownSeedRuleError",
    "UnsupportedVersionError",
    "advance_seed",
    "draw_seed",
    "assemble",
    "atomic_write",
    "decode_manifest",
    "encode_manifest",
    "open_bundle",
    "read_manifest",
    "validate",
    "write_bundle",
]
