"""The front-ends' error type, and the refusals both front-ends make in the same words.

Imports: torch (for types), stepbundle.schema.
"""

from __future__ import annotations

import torch

from stepbundle.schema.errors import BundleError

__all__ = ["ExportError", "MetaTensorError", "not_a_parameter"]


class ExportError(BundleError):
    """The step cannot be exported faithfully; the message says why and how to fix it.

    The exporter refuses rather than write a bundle that would replay the step wrong.
    """


class MetaTensorError(ExportError):
    """A state tensor is on the ``meta`` device (no values) where the bundle needs its values:
    a weights-holding export (``include_state=True``) of a model built on meta, or a
    non-persistent buffer (rotary tables, masks) on meta, which no checkpoint holds."""


def not_a_parameter(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> ExportError:
    """The refusal of an optimizer that updates a tensor the model does not hold."""
    return ExportError(
        f"The optimizer ({type(optimizer).__name__}) updates a tensor of shape "
        f"{tuple(tensor.shape)} that is not a parameter of the model. Build the "
        "optimizer over model.parameters() (or named subsets of them)."
    )
