"""evaluate_dataset: each metric's mean over every real row, whatever the batch sizes,
with a padded last batch masked. The oracle is the linear model in numpy, float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import golden_bundle

from stepbundle.runtime import BindingError, load
from stepbundle.runtime.data.dataset import open_dataset
from stepbundle.runtime.data.dataset_writer import write_dataset
from stepbundle.runtime.data.loader import Loader

ROWS = 21  # 2 batches of 8 and a last batch of 5 (which is also a bucket)


def numpy_oracle(state: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    w, b = state["weight"].astype(np.float64), state["bias"].astype(np.float64)
    pred = x.astype(np.float64) @ w.T + b
    return {
        "loss": float(((pred - y) ** 2).mean()),
        "pred_mean": float(pred.mean()),
    }


@pytest.fixture
def data(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, 5)).astype(np.float32)
    y = rng.standard_normal((ROWS, 3)).astype(np.float32)
    write_dataset(tmp_path / "ds", {"x": x, "y": y}, rows_per_shard=10)
    return tmp_path / "ds", x, y


@pytest.mark.parametrize("last_batch", ["keep", "pad"])
def test_the_mean_over_every_row(
    data: tuple[Path, np.ndarray, np.ndarray], last_batch: str
) -> None:
    path, x, y = data
    t = load(golden_bundle("linear_adamw"))
    loader = Loader(
        open_dataset(path), 8, shuffle=False, epochs=1, last_batch=last_batch, mask_key="mask"
    )
    result = t.evaluate_dataset(loader, mask_key="mask")
    want = numpy_oracle(t.state_dict(), x, y)
    assert result.rows == ROWS and result.batches == 3
    for k, v in want.items():
        assert result.metrics[k] == pytest.approx(v, rel=1e-5), k
    # The padded batch alone (the program's own mean) is not the answer: masking matters.
    if last_batch == "pad":
        last = list(Loader(open_dataset(path), 8, shuffle=False, epochs=1, last_batch="pad"))[-1]
        naive = float(t.evaluate(last)["loss"])
        assert naive != pytest.approx(
            numpy_oracle(t.state_dict(), x[16:], y[16:])["loss"], rel=1e-3
        )


def test_evaluation_changes_no_state_and_refuses_nothing_to_do(
    data: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    path, _, _ = data
    t = load(golden_bundle("linear_adamw"))
    before = t.state_dict()
    t.evaluate_dataset(Loader(open_dataset(path), 8, shuffle=False, epochs=1, last_batch="drop"))
    for k, v in t.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    assert t.step_count == 0
    with pytest.raises(BindingError, match="got no batches"):
        t.evaluate_dataset([])
    with pytest.raises(BindingError, match="'train' updates the state"):
        t.evaluate_dataset(Loader(open_dataset(path), 8, shuffle=False, epochs=1), entry="train")
