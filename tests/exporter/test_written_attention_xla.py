"""Written-out attention exported by torch_xla, fused on a TPU: the forms of
``tests/attention_forms.py`` (a ``tril`` mask made in forward, nanoGPT's buffer,
``arange`` positions in a layer of one head, an added float mask; batch 1) and Hugging
Face's GPT-2 with ``attn_implementation="eager"``, as
tests/frontend_torch/test_written_attention.py holds the torch front-end to them.
torch_xla writes a batch of one head's mask as a reshape, not a broadcast, and the
fill as a reshape of a scalar: the matcher reads both."""

from __future__ import annotations

from pathlib import Path

import attention_forms as forms
import numpy as np
import pytest

from stepbundle.exporter import Recipe, export


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("written_xla") / "forms.stepbundle"
    return path, forms.export_with(export, Recipe, path)


def test_fused_matches_float64_as_well_as_the_traced_one(bundle: tuple[Path, dict]) -> None:
    forms.check_fused_against_float64(*bundle)


def test_hugging_face_gpt2_eager_is_matched(tmp_path: Path) -> None:
    forms.gpt2_eager_sites(export, Recipe, tmp_path / "gpt2-eager.stepbundle")
