"""Typed errors of the bundle format.

Every failure to read, validate or use a bundle is a ``BundleError``; callers that only
want to know "is this bundle usable" catch that one class. The runtime's
``BindingError`` and the exporter's ``ExportError`` derive from it too.

Messages are whole sentences: what was wrong, where, and what to do about it.

Imports: standard library only.
"""

from __future__ import annotations

__all__ = [
    "BundleError",
    "BundleFormatError",
    "CheckpointError",
    "CheckpointFormatError",
    "IntegrityError",
    "SchemaValidationError",
    "UnsupportedVersionError",
]


class BundleError(Exception):
    """Base class of every error stepbundle raises about a bundle or its use."""


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


class CheckpointError(BundleError):
    """A checkpoint does not match the bundle, or could not be read."""


class CheckpointFormatError(CheckpointError):
    """The checkpoint's format number is one this reader does not know."""
