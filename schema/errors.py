"""Typed errors: the roots a user catches, and the bundle format's own refusals.

Every error stepbundle raises is a ``StepbundleError``, under one of five roots a caller
can catch (``from stepbundle import BundleError, ...``):

- ``BundleError``: a bundle cannot be read, trusted, fetched, written or bound to a call
  (format, version, schema, digests, binding tables, export refusals, remote reads);
- ``CheckpointError``: a checkpoint does not match the bundle, or cannot be read or
  written;
- ``DataError``: a dataset, a token stream or a loader was refused, or a run's metrics
  output could not be written (``kind`` says which);
- ``DeviceError``: the platform cannot run the bundle, the device failed during a step,
  or a step went non-finite where the trainer was told to stop;
- ``UsageError``: an argument or option is wrong (also a ``ValueError``, as such
  refusals were before the roots existed).

The roots live here, at the bottom of the layers, because every package imports the
schema and the schema imports only the standard library: the runtime, the front-ends
and the CLI derive their few subclasses from them, and the face re-exports them. A
subclass exists only where a caller handles it differently or reads its fields.

Messages are whole sentences: what was wrong, where, and what to do about it.

Imports: standard library only.
"""

from __future__ import annotations

import enum

__all__ = [
    "BundleError",
    "BundleFormatError",
    "CheckpointError",
    "DataError",
    "DeviceError",
    "IntegrityError",
    "SchemaValidationError",
    "StepbundleError",
    "UnsupportedVersionError",
    "UsageError",
]


class StepbundleError(Exception):
    """Base class of every error stepbundle raises: catch it to catch them all."""


class BundleError(StepbundleError):
    """A bundle cannot be read, trusted, fetched, written or bound to a call (a root)."""


class BundleFormatError(BundleError):
    """The bytes are not a bundle this reader can parse: bad magic, truncated, oversized.

    Raised before any manifest field is trusted.
    """


class UnsupportedVersionError(BundleFormatError):
    """The bundle's format version or required features are not supported by this reader."""

    def __init__(
        self,
        message: str,
        *,
        found: tuple[int, int] | None = None,
        missing_features: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.found = found
        self.missing_features = missing_features


class SchemaValidationError(BundleError):
    """The manifest parsed but breaks a rule of the schema.

    ``path`` names the offending field, for example
    ``entries.train.programs[0].inputs[3].dtype``.
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.reason = message


class IntegrityError(BundleError):
    """A digest did not match: the file was damaged or altered after it was written."""


class CheckpointError(StepbundleError):
    """A checkpoint does not match the bundle, or could not be read or written (a root).

    A checkpoint of a format number this reader does not know is one too: its message
    names both numbers.
    """


class DataError(StepbundleError):
    """Data a run reads or writes was refused (a root): a dataset folder, a token
    stream, a loader's arguments or state, or a run's metrics output.

    ``kind`` says which failure (``stepbundle.runtime.data.DataErrorKind``: tests match
    on it, not on wording); ``path`` is the file concerned, when there is one. Raised
    before anything is dispatched, or between steps.
    """

    def __init__(self, kind: enum.Enum, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.path = path


class DeviceError(StepbundleError):
    """Running on the device failed (a root): the device runtime failed while running a
    step (out of memory, a lost device), the platform cannot run the bundle
    (``PlatformError``), or a step went non-finite where the trainer was told to stop
    (``NonFiniteLossError``).

    If a failed step donated its state, the trainer refuses further use until a
    checkpoint or the bundle is loaded again; the message says which.
    """


class UsageError(StepbundleError, ValueError):
    """An argument, option or path given to stepbundle is wrong (a root); the message
    says which and what would do. Also a ``ValueError``."""
