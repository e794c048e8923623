"""The runtime's error types: the roots (``stepbundle.schema.errors``), named here because
the runtime's users catch them from here, and the few subclasses a caller handles apart.

Imports: stepbundle.schema only.
"""

from __future__ import annotations

from stepbundle.schema.errors import (
    BundleError,
    CheckpointError,
    DataError,
    DeviceError,
    StepbundleError,
    UsageError,
)

__all__ = [
    "BatchStackError",
    "BindingError",
    "BundleError",
    "CheckpointError",
    "DataError",
    "DeviceError",
    "NonFiniteLossError",
    "PlatformError",
    "StepbundleError",
    "UsageError",
]


class BindingError(BundleError):
    """A call's arguments do not match what the bundle's programs expect.

    Raised before anything is dispatched: no state buffer has been donated.
    """


class BatchStackError(BindingError):
    """A stack of K batches (``Trainer.step_many``) does not have the shape a K-step
    call takes: K rows of one shape bucket on every batch input.

    Raised before anything is dispatched: no state buffer has been donated.
    """


class PlatformError(DeviceError):
    """The bundle cannot run on the requested device or platform (refused at load,
    before anything ran: nothing to recover, unlike a step's ``DeviceError``)."""


class NonFiniteLossError(DeviceError):
    """A step produced a non-finite loss and the trainer was told to stop on it.

    The trainer's state is the state from before that step (``step`` and ``metrics``
    say which step and what it produced): a caller saves it, unlike after a
    ``DeviceError`` of a failed device.
    """

    def __init__(self, message: str, *, step: int, metrics: dict[str, float]) -> None:
        super().__init__(message)
        self.step = step
        self.metrics = metrics
