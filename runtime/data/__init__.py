"""Datasets on disk: the folder layout and its index (``dataset``, ``dataset_index``), its
streaming writer (``dataset_writer``), the shuffled, resumable reader (``loader``) and
evaluation over a whole dataset (``evaluation``).

May import: the base modules and ``io``.
"""

from __future__ import annotations

from .dataset import DataError, Dataset, open_dataset
from .dataset_writer import DatasetWriter, write_dataset
from .evaluation import Evaluation, evaluate_dataset
from .loader import Loader, LoaderState

__all__ = [
    "DataError",
    "Dataset",
    "DatasetWriter",
    "Evaluation",
    "Loader",
    "LoaderState",
    "evaluate_dataset",
    "open_dataset",
    "write_dataset",
]
