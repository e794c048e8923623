"""Non-finite watch: with ``stop_on_nonfinite``, a step whose metrics (or, with
``check_state``, whose new state) hold a NaN or an infinity is not applied.

Programs are compiled without donation in this mode, so the state from before the step
is intact when the check fails: the trainer keeps it, and the caller can save it. The
metric check reads every metric of the step (each a small device-to-host copy, and a
wait for the step). The state check runs one compiled reduction over the step's new
state buffers on the device and reads back one boolean: the state never leaves the
device.

Imports: numpy, jax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import NonFiniteLossError

__all__ = ["check_step", "finite"]


def _all_finite(*arrays: Any) -> Any:
    flags = [jnp.all(jnp.isfinite(a)) for a in arrays if jnp.issubdtype(a.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


_ALL_FINITE: Any = jax.jit(_all_finite)


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        if a.size == 1:
            out[k] = float(a.reshape(()))
    return out


def finite(metrics: Mapping[str, Any], new_state: Sequence[Any] | None) -> bool:
    """Whether every metric (and ``new_state``, unless None) is finite: a K-step call's
    quick check (the trainer replays a call that fails it step by step, so the step
    at fault is found and refused by ``check_step``)."""
    for v in metrics.values():
        a = np.asarray(v)
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            return False
    return not new_state or bool(_ALL_FINITE(*new_state))


def check_step(step: int, metrics: Mapping[str, Any], new_state: Sequence[Any] | None) -> None:
    """Raise ``NonFiniteLossError`` if a metric (or ``new_state``) is not finite.

    Args:
      step: the number of steps taken before this one (for the message).
      metrics: the step's metrics.
      new_state: the state buffers the step would install, or None not to check them.
    """
    bad = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            bad[k] = float(a.reshape(-1)[~np.isfinite(a.reshape(-1))][0])
    if bad:
        names = ", ".join(f"{k} = {v}" for k, v in bad.items())
        raise NonFiniteLossError(
            f"Step {step} produced non-finite metrics ({names}). The trainer kept the state "
            "from before this step; save it with trainer.save_checkpoint(...) and lower the "
            "learning rate or inspect the batch.",
            step=step,
            metrics=_scalars(metrics),
        )
    if new_state and not bool(_ALL_FINITE(*new_state)):
        scalars = _scalars(metrics)
        shown = ", ".join(f"{k} = {v:.6g}" for k, v in scalars.items() if math.isfinite(v))
        raise NonFiniteLossError(
            f"Step {step} would have written NaN or infinite values into the state, while "
            f"its metrics looked finite ({shown or 'none'}). The trainer kept the state "
            "from before this step; save it with trainer.save_checkpoint(...) and inspect "
            "the batch (a NaN input, say) or lower the learning rate.",
            step=step,
            metrics=scalars,
        )
