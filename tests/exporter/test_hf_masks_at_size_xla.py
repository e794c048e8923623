"""Hugging Face's causal masks at batch 8 and T = 1024, torch_xla front-end (#38).

At that size transformers' mask (the causal triangle and-ed with a packed-sequence mask
from the position ids) is 8M elements: the load computed it element by element up to 1M
and gave up, and no layer of HF GPT-2 or Llama was fused on the v5e. It is now computed
over its distinct values (``stablehlo/mask_values.py``): one (T, T) triangle. Tiny widths
and one layer keep each export to seconds; ``tests/hf_masks.py`` reads what the load's
matcher and composite fold make of the program (torch_xla writes SDPA as a composite
whose mask operand is HF's; the load folds it to is_causal). The torch front-end's is
tests/frontend_torch/test_hf_masks_at_size.py.
"""

from __future__ import annotations

import hf_masks
import pytest

from stepbundle.exporter import Recipe, export

CASES = {
    "gpt2-sdpa": ("gpt2", "sdpa", False),
    "gpt2-eager": ("gpt2", "eager", False),
    "llama-sdpa": ("llama", "sdpa", False),
    "gpt2-eager-padding": ("gpt2", "eager", True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def read(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    kind, impl, padding = CASES[request.param]
    path = tmp_path_factory.mktemp("hf") / f"{request.param}.stepbundle"
    net = hf_masks.export_with(export, Recipe, path, kind, impl, padding)
    return request.param, hf_masks.sites(path, net)


def test_every_layer_is_fused_and_a_padding_mask_is_not(read: tuple) -> None:
    case, (matched, folded, misses) = read
    _, impl, padding = CASES[case]
    if padding:  # the mask reads the batch's attention_mask: not causal, and said so
        assert (matched, folded) == (0, 0)
        assert misses and all("the batch input 'attention_mask'" in m for m in misses), misses
    elif impl == "eager":  # written out: the matcher takes the layer's attention
        assert (matched, folded, misses) == (1, 0, [])
    else:  # SDPA composites, forward and backward, their mask folded to is_causal
        assert (matched, folded, misses) == (0, 2, [])
