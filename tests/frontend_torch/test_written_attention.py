"""Written-out attention exported by the torch front-end, fused on a TPU (#38 item 2).

The torch front-end lowers written-out attention its own way (products float32-out then
converted, ``amax`` through ``max(-inf, m)``, broadcasts in two steps, torch's softmax
gradient; before 7013169, ``torch.where`` as a private function call, which the matcher
inlines); the matcher
(``stablehlo/attention.py``) reads those forms as it reads torch_xla's. The model of
``tests/attention_forms.py`` writes its causal mask four ways (``tril`` in forward,
nanoGPT's buffer, ``arange`` positions in a layer of one head, an added float mask;
batch 1): each layer's attention is fused (the kernels interpreted on the CPU), and the
fused step is held to PyTorch float64 as the traced one is. Hugging Face's GPT-2 with
``attn_implementation="eager"`` is matched. tests/exporter/test_written_attention_xla.py
holds the torch_xla front-end to the same.
"""

from __future__ import annotations

from pathlib import Path

import attention_forms as forms
import numpy as np
import pytest

from stepbundle.export_torch import Recipe, export
from stepbundle.schema.reader import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.attention import find_attention


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("written") / "forms.stepbundle"
    return path, forms.export_with(export, Recipe, path)


def test_every_form_is_matched_with_its_backward(bundle: tuple[Path, dict]) -> None:
    path, initial = bundle
    with open_bundle(path) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
        buffers = {
            i: (inp.name, lambda n=inp.name: initial[n].reshape(-1).tolist())
            for i, inp in enumerate(program.inputs)
            if getattr(inp, "name", None) in forms.MASK_BUFFERS
        }
    sites = find_attention(module, {}, state=buffers)
    assert "call @" not in module.text()  # private functions inlined before matching
    assert sorted(s.heads for s in sites) == sorted(h for _, h in forms.FORMS)
    assert all(s.causal and s.do is not None and s.batch == 1 for s in sites)
    # the buffer's mask read as loaded: the upper triangle is not causal
    upper = np.triu(np.ones((forms.T, forms.T), np.float32)).reshape(-1).tolist()
    wrong = {i: (name, lambda: upper) for i, (name, _) in buffers.items()}
    misses: list[str] = []
    assert len(find_attention(module, {}, misses, wrong)) == len(forms.FORMS) - 1
    assert any("blocks.1.bias" in m and "not the causal triangle" in m for m in misses)


def test_fused_matches_float64_as_well_as_the_traced_one(bundle: tuple[Path, dict]) -> None:
    forms.check_fused_against_float64(*bundle)


def test_hugging_face_gpt2_eager_is_matched(tmp_path: Path) -> None:
    forms.gpt2_eager_sites(export, Recipe, tmp_path / "gpt2-eager.stepbundle")
