"""stablehlo/mask_values.py: masks computed at load over their distinct values (#38).

Masks written with jax in the forms Hugging Face's reach the program in (transformers'
``masking_utils`` through torch_xla: a causal triangle and-ed with a packed-sequence mask
from the position ids, a running sum read back with a gather), at batch 8 and T = 1024,
8M elements where the load computed 1M: computed as one (T, T) triangle. A mask that
reads an input is not computed and the reason names it; one that varies over more than
the limit says its shape; one computed and not causal is not taken as causal.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxlib.mlir.dialects import stablehlo

from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.inline import inline_private_calls
from stepbundle.stablehlo.mask_values import MaskValues, compute_mask, is_causal

B, T = 8, 1024


def _computed(fn: Any, *args: Any, names: dict[int, str] | None = None) -> MaskValues:
    text = jax.jit(fn).lower(*args).as_text()
    module = mlir.parse_artifact(
        stablehlo.serialize_portable_artifact_str(text, stablehlo.get_current_version())
    )
    inline_private_calls(module)  # as the matcher does before it reads a mask
    with module._ctx:
        main = next(
            op.operation
            for op in module._module.body.operations
            if str(op.operation.attributes["sym_name"]).strip('"') == "main"
        )
        ret = list(main.regions[0].blocks[0].operations)[-1]
        return compute_mask(ret.operands[0], {}, {}, names)


def _packed_causal(positions: Any) -> Any:
    """HF's mask: (j <= i) and both positions in one packed sequence."""
    first = positions[:, :1] - 1
    starts = (jnp.diff(positions, prepend=first, axis=-1) != 1).astype(jnp.uint8)
    packed = lax.reduce_window(starts, jnp.uint8(0), lax.add, (1, T), (1, 1), [(0, 0), (T - 1, 0)])
    b = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    q = jnp.broadcast_to(jnp.arange(T)[None, :], (B, T))
    seq = packed[b, q]
    i = jnp.arange(T)
    causal = i[None, :] <= i[:, None]
    return (causal[None] & (seq[:, :, None] == seq[:, None, :]))[:, None]


def test_hugging_faces_mask_at_batch_8_and_1024_is_one_triangle() -> None:
    got = _computed(lambda: _packed_causal(jnp.broadcast_to(jnp.arange(T), (B, T))))
    assert got.why == "" and got.values is not None
    assert got.values.shape == (B, 1, T, T) and got.values.keep == (2, 3)
    assert len(got.values.data) == T * T
    assert is_causal(got.values, bool, lambda v: not v)
    # the other way round is not causal
    assert not is_causal(got.values, lambda v: not v, bool)


def test_a_mask_from_the_batch_is_not_computed_and_names_it() -> None:
    got = _computed(
        lambda m: (jnp.tril(jnp.ones((T, T), bool))[None] & (m[:, None, :] > 0))[:, None],
        jnp.ones((B, T), jnp.int32),
        names={0: "the batch input 'attention_mask'"},
    )
    assert got.values is None
    assert "the batch input 'attention_mask'" in got.why, got.why


def test_a_mask_that_varies_over_the_batch_says_its_size() -> None:
    i = jnp.arange(T)
    got = _computed(lambda: i[None, None, :] <= i[None, :, None] + jnp.arange(B)[:, None, None])
    assert got.values is None
    assert f"[{B}, {T}, {T}]" in got.why and "larger than the load computes" in got.why


def test_a_shifted_packed_sequence_is_computed_and_not_causal() -> None:
    # two sequences packed in each row: positions restart at 512
    positions = jnp.broadcast_to(jnp.concatenate([jnp.arange(512), jnp.arange(512)]), (B, T))
    got = _computed(lambda: _packed_causal(positions))
    assert got.values is not None
    assert not is_causal(got.values, bool, lambda v: not v)
