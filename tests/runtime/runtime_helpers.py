"""Helpers for the runtime tests: golden bundles, their inputs and expected outputs.

No torch here: these tests also run in the lean environment.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from stepbundle.runtime.trainer import iter_batches

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"
GOLDEN_NAMES = ("linear_adamw", "dropout_sgd", "batchnorm_lr")
GOLDEN_STEPS = {"linear_adamw": 5, "dropout_sgd": 5, "batchnorm_lr": 6}
GOLDEN_SCHEDULES = {"batchnorm_lr": "warmup_cosine:peak=0.02,warmup=2,total=6,min=0.001"}


def golden_bundle(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.stepbundle"


def golden_batches(name: str) -> list[dict[str, np.ndarray]]:
    with np.load(GOLDEN_DIR / f"{name}.inputs.npz", allow_pickle=False) as z:
        return iter_batches({k: z[k] for k in z.files})


def golden_expected(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN_DIR / f"{name}.expected.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def rel(a: np.ndarray, b: np.ndarray, floor: float = 1e-6) -> float:
    """max|a-b| / max(max|b|, floor): the tensor's relative error at its own scale."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), floor)
