"""What the user hands the exporter: a model, an optimizer and their ordinary step.

Imports: torch (for types only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["EvalFn", "Recipe", "StepFn", "checked_metadata", "read_only_entries", "step_label"]

StepFn = Callable[
    [torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]], Mapping[str, Any]
]
"""``step(model, optimizer, batch) -> {"loss": tensor, ...}``: forward, backward, optimizer step."""

EvalFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], Mapping[str, Any]]
"""``eval_step(model, batch) -> {"name": tensor, ...}``: runs under ``model.eval()`` and no_grad."""


@dataclass
class Recipe:
    """A training step to export, exactly as the user would run it eagerly.

    Attributes:
      model: the ``nn.Module``, on the CPU or already on the XLA device.
      optimizer: a ``torch.optim.Optimizer`` built over ``model``'s parameters.
      step: the user's imperative training step, returning a dict of scalar tensors
        that includes ``"loss"``.
      example_batch: a dict of name -> CPU tensor. Its shapes and dtypes become the
        first shape bucket of every entry.
      example_batches: further example batches; each one with a different shape
        becomes another shape bucket (for example a short last batch).
      eval_step: optional read-only step, exported as the ``eval`` entry.
      entries: further read-only entries by name, called like ``eval_step``.
      hyperparameters: optimizer ``param_groups`` keys (``"lr"``, ...) to export as
        named scalar inputs the runtime sets on every step instead of constants.
      seed: torch_xla RNG seed the first exported step receives. ``None`` takes the
        process's current torch_xla RNG state.
      metadata: strings for the people and tools that handle the bundle, written into
        its manifest and shown by ``stepbundle inspect``: by convention ``name``,
        ``description`` and ``source_commit``, plus any labels (``{"team": "vision"}``).
      include_state: False writes a bundle without weights: parameters and persistent
        buffers have no stored value (a run takes them from a checkpoint,
        ``StateOptions(init_from=...)``), a fresh optimizer's state is described by rule (zeros),
        and the bundle is its programs and tables (``frontend_core/initial_state.py``).
      numerics: ``"pytorch"`` (the default) writes training BatchNorm as PyTorch's
        kernels compute it (the mean first, then the mean of squared deviations), in
        plain StableHLO that every XLA release runs the same way; ``"torch_xla"``
        keeps torch_xla's ``batch_norm_training`` / ``batch_norm_grad`` ops, which XLA
        expands with the cancellation-prone E[x^2] - E[x]^2, so that a bundle equals
        torch_xla eager (``exporter/numerics.py``). Recorded as ``Manifest.numerics``.
        The torch front-end (``stepbundle.export_torch``) computes PyTorch's numerics
        only and refuses ``"torch_xla"``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: StepFn
    example_batch: Mapping[str, torch.Tensor]
    example_batches: Sequence[Mapping[str, torch.Tensor]] = ()
    eval_step: EvalFn | None = None
    entries: Mapping[str, EvalFn] = field(default_factory=dict)
    hyperparameters: Sequence[str] = ()
    seed: int | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    include_state: bool = True
    numerics: str = "pytorch"

    def all_batches(self) -> list[Mapping[str, torch.Tensor]]:
        """The example batches, one per shape bucket, first bucket first."""
        return [self.example_batch, *self.example_batches]


def checked_metadata(metadata: object) -> dict[str, str]:
    """``Recipe.metadata`` as a plain dict, refused unless every key (non-empty) and every
    value is a string."""
    from .errors import ExportError

    if not isinstance(metadata, Mapping):
        raise ExportError(
            f"Recipe.metadata must be a dict of strings, got {type(metadata).__name__}; "
            'write e.g. metadata={"name": "resnet18", "source_commit": "3f2c1e0"}.'
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise ExportError(
                f"Recipe.metadata[{key!r}] = {value!r}: every key must be a non-empty string "
                f"and every value a string (got {type(key).__name__} -> "
                f"{type(value).__name__}). Convert it, e.g. str(value)."
            )
    return dict(metadata)


def read_only_entries(recipe: Recipe) -> dict[str, EvalFn]:
    """The recipe's read-only entries by name: ``eval`` (its ``eval_step``) first, then
    ``entries``.

    Raises:
      ExportError: an entry is called ``train``, the training step's name.
    """
    from .errors import ExportError

    fns: dict[str, EvalFn] = dict(recipe.entries)
    if recipe.eval_step is not None:
        fns = {"eval": recipe.eval_step, **fns}
    if "train" in fns:
        raise ExportError(
            'Recipe.entries may not be called "train"; that entry is the training step.'
        )
    return fns


def step_label(what: str, bucket: int, buckets: int) -> str:
    """``what`` ("training step", "eval step"), naming the shape bucket when there are
    several: "training step (shape bucket 1)"."""
    return what + (f" (shape bucket {bucket})" if buckets > 1 else "")
