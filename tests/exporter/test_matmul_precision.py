"""The exporter records the matmul precision torch_xla traced at (Manifest.matmul_precision).

The oracle is torch_xla's own setter; the recorded value is read back from the bundle file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch_xla.backends
from export_helpers import mse_step

from stepbundle.exporter import Recipe, export
from stepbundle.schema import open_bundle


@pytest.fixture
def restore_precision() -> Iterator[None]:
    before = torch_xla.backends.get_mat_mul_precision()
    yield
    torch_xla.backends.set_mat_mul_precision(before)


def _recipe() -> Recipe:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        step=mse_step,
        example_batch={"x": torch.randn(3, 4), "y": torch.randn(3, 2)},
    )


@pytest.mark.parametrize("precision", ["highest", "high", "default"])
def test_the_traced_precision_is_recorded(
    tmp_path: Path, precision: str, restore_precision: None
) -> None:
    torch_xla.backends.set_mat_mul_precision(precision)  # type: ignore[arg-type]
    path = tmp_path / f"{precision}.stepbundle"
    export(_recipe(), path)
    with open_bundle(path) as bundle:
        assert bundle.version == (1, 2)
        assert bundle.manifest.matmul_precision == precision
