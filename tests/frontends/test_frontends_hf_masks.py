"""Hugging Face's causal masks at batch 8 and T = 1024, on both front-ends (#38).

At that size transformers' mask (the causal triangle and-ed with a packed-sequence mask
from the position ids) is 8M elements: the load computed it element by element up to 1M
and gave up, and no layer of HF GPT-2 or Llama was fused on the v5e. It is now computed
over its distinct values (``stablehlo/mask_values.py``): one (T, T) triangle. Tiny widths
and one layer keep each export to seconds; ``tests/hf_masks.py`` reads what the load's
matcher and composite fold make of the program, with the scalar constants the load hands
them. torch_xla writes SDPA as a composite whose mask operand is HF's, which the load
folds to ``is_causal``; the torch front-end folds it at export.
"""

from __future__ import annotations

from pathlib import Path

import hf_masks
import pytest

from stepbundle.frontend import Recipe

CASES = {
    "gpt2-sdpa": ("gpt2", "sdpa", False),
    "gpt2-eager": ("gpt2", "eager", False),
    "llama-sdpa": ("llama", "sdpa", False),
    "gpt2-eager-padding": ("gpt2", "eager", True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_layer_is_fused_and_a_padding_mask_is_not(
    case: str, frontend, tmp_path: Path
) -> None:
    kind, impl, padding = CASES[case]
    path = tmp_path / f"{case}.stepbundle"
    net = hf_masks.export_with(frontend.export, Recipe, path, kind, impl, padding)
    matched, folded, misses = hf_masks.sites(path, net)
    if padding:  # the mask reads the batch's attention_mask: not causal, and said so
        assert (matched, folded) == (0, 0)
        assert misses and all("the batch input 'attention_mask'" in m for m in misses), misses
    elif impl == "eager":  # written out: the matcher takes the layer's attention
        assert (matched, folded, misses) == (1, 0, [])
    else:  # SDPA composites, forward and backward, their mask folded to is_causal
        assert (matched, folded, misses) == (0, 2, [])
