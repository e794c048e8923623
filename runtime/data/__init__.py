"""Datasets on disk: the folder layout and its index (``dataset``, ``dataset_index``), its
streaming writer (``dataset_writer``), the shuffled, resumable reader (``loader``),
token streams for language models (``tokens``) and evaluation over a whole dataset
(``evaluation``).

May import: the base modules and ``io``.
"""

from __future__ import annotations

from .dataset import DataError, Dataset, open_dataset
from .dataset_writer import DatasetWriter, write_dataset
from .evaluation import Evaluation, evaluate_dataset
from .loader import Loader, LoaderState
from .tokens import TokenStream, open_tokens

__all__ = [
    "DataError",
    "Dataset",
    "DatasetWriter",
    "Evaluation",
    "Loader",
    "LoaderState",
    "TokenStream",
    "evaluate_dataset",
    "open_dataset",
    "open_tokens",
    "write_dataset",
]
