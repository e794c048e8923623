"""``stablehlo/inline.py``: private function calls replaced by the functions' bodies.

A normalization the attention matcher runs first (a front-end may write ``torch.where``
as ``call @_where``): the program must compute the same values after it. A jax program
with a nested ``jit`` and ``jnp.where`` (each written as a private function call) is
inlined, then compiled and run on the CPU beside the original.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxlib.mlir.dialects import stablehlo
from runtime_helpers import run_on_cpu

from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.inline import inline_private_calls


@jax.jit
def _inner(m: Any, a: Any, b: Any) -> Any:
    return jnp.where(m, a, b) + jnp.sum(a, axis=-1, keepdims=True)


def _step(m: Any, a: Any, b: Any) -> Any:
    return _inner(m, a, b) * 2.0 + _inner(~m, b, a)


def test_inlined_calls_compute_the_same_values() -> None:
    rng = np.random.default_rng(0)
    m = rng.random((4, 8)) < 0.5
    a, b = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2))
    text = jax.jit(_step).lower(m, a, b).as_text()
    target = stablehlo.get_current_version()
    artifact = stablehlo.serialize_portable_artifact_str(text, target)
    module, original = mlir.parse_artifact(artifact), mlir.parse_artifact(artifact)
    assert module.text().count("call @") >= 3  # _inner twice, and jnp.where inside it
    assert inline_private_calls(module) >= 3
    main = module.text().split("func.func private")[0]
    assert "call @" not in module.text() and "stablehlo.select" in main
    (want,) = run_on_cpu(original, m, a, b)
    (got,) = run_on_cpu(module, m, a, b)
    assert np.array_equal(got, want)
    # and both are the function itself
    ref = 2 * (np.where(m, a, b) + a.sum(-1, keepdims=True)) + np.where(~m, b, a)
    assert np.allclose(want, ref + b.sum(-1, keepdims=True), rtol=1e-6)
