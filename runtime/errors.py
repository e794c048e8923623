"""The runtime's error types.

Imports: stepbundle.schema only.
"""

from __future__ import annotations

# CheckpointError is the schema's (schema/checkpoint_meta.py raises it, for the runtime and
# for load_into alike), named here too because the runtime's users catch it from here.
from stepbundle.schema.errors import BundleError, CheckpointError

__all__ = [
    "BatchStackError",
    "BindingError",
    "CheckpointError",
    "DeviceError",
    "NonFiniteLossError",
    "PlatformError",
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


class PlatformError(BundleError):
    """The bundle cannot run on the requested device or platform."""


class DeviceError(BundleError):
    """The device runtime failed while running a step (out of memory, a lost device).

    If the step donated its state, the trainer refuses further use until a checkpoint
    or the bundle is loaded again; the message says which.
    """


class NonFiniteLossError(BundleError):
    """A step produced a non-finite loss and the trainer was told to stop on it.

    The trainer's state is the state from before that step.
    """

    def __init__(self, message: str, *, step: int, metrics: dict[str, float]) -> None:
        super().__init__(message)
        self.step = step
        self.metrics = metrics
