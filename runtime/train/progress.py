"""Where training stands: steps taken, the seed the next step receives, the data position.

``Progress`` is the trainer's part that owns these three (checkpoints store all of
them). The seed advances by the rule the bundle names (``stepbundle.schema.rng``); an
unknown rule fails when the part is made, at load, rather than at the first step.

Imports: stepbundle.schema.
"""

from __future__ import annotations

from typing import Any

from stepbundle.schema.manifest import Manifest
from stepbundle.schema.rng import TORCH_XLA_MARK_STEP, advance_seed

from ..errors import BindingError

__all__ = ["Progress"]

_U64 = 2**64


class Progress:
    """Steps taken, the next step's RNG seed, and where the data stands.

    Attributes:
      step: the number of training steps taken (restored from checkpoints).
      seed: the RNG seed the next training step receives; None when no program uses one.
      data_position: where the data stands for the next step (a loader's ``state()``),
        or None.
    """

    def __init__(self, manifest: Manifest, seed: int | None) -> None:
        self.step = 0
        self.seed = seed
        self.data_position: Any = None
        self._rule = manifest.rng.rule if manifest.rng is not None else TORCH_XLA_MARK_STEP
        # A step that restored torch_xla's RNG state mid-step advances from the seed N
        # draws on (Rng.step_after_draws).
        self._draws = manifest.rng.step_after_draws if manifest.rng is not None else 0
        if seed is not None:
            advance_seed(self._rule, seed, 0)

    def set_seed(self, value: int) -> None:
        """Set the next step's seed (``Trainer.seed = value``), checked."""
        if self.seed is None:
            raise BindingError(
                "This bundle's programs use no random numbers, so it has no seed to set."
            )
        if not isinstance(value, int) or not 0 <= value < _U64:
            raise BindingError(f"The seed must be an integer in [0, 2**64), got {value!r}.")
        self.seed = value

    def seeds(self, k: int) -> list[int]:
        """The seeds of the next ``k`` steps (a K-step call); the seed must be set."""
        assert self.seed is not None
        out = [self.seed]
        for _ in range(k - 1):
            out.append(advance_seed(self._rule, out[-1], 1, self._draws))
        return out

    def advance(self, k: int = 1) -> None:
        """``k`` training steps were applied: count them and move the seed on."""
        self.step += k
        if self.seed is not None:
            self.seed = advance_seed(self._rule, self.seed, k, self._draws)
