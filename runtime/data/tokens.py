"""A token stream: one array of tokens, windows of the bundle's context cut from it at
random offsets (nanoGPT's sampling), seeded and resumable like the dataset loader.

A language model's training data is one long sequence of token ids. Writing it out as
overlapping windows costs ``context`` times its size (a new user turned 1.8 MB of text
into 57 MB of int64 windows); ``TokenStream`` reads a 1-D ``.npy`` of token ids as a
dataset's shards are read (``shard_file.py``: a memory map under a read lease, else pread;
a file truncated under a run is a ``DataError``, never a SIGBUS) and cuts each batch's
windows when it is asked for one:

- batch ``i`` takes ``batch_size`` offsets drawn by ``numpy.random.Generator(PCG64([seed,
  i]))`` from ``[0, tokens - context - 1]``: a pure function of (seed, i), so a resumed
  run (``state()`` / ``set_state``) draws exactly the batches the uninterrupted run would;
- for a bundle with two token inputs (``x``, ``y`` in nanoGPT) the second is the first
  shifted by one token; with one (Hugging Face's ``input_ids``, the labels taken from it
  inside the model) it is the window alone;
- each process of a multi-process job takes its own rows of every global batch.

Imports: numpy, the standard library, ``stepbundle.schema.errors`` (and this package's
``dataset_index`` errors and ``shard_file``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stepbundle.schema.errors import UsageError

from .dataset_index import DataError, DataErrorKind
from .shard_file import ShardFile, open_shard_file, read_npy_header

__all__ = ["TOKENS_FORMAT", "TOKENS_STATE_VERSION", "TokenFile", "TokenStream", "open_tokens"]

TOKENS_FORMAT = "stepbundle.tokens"
# The stream's state version. Readers accept every version up to their own.
# 1 (2026-12-06): {format, version, seed, batch, tokens, batch_size, context}; batch i's
#   offsets = Generator(PCG64([seed, i])).integers(0, tokens - context, batch_size).
TOKENS_STATE_VERSION = 1
_STATE_KEYS = ("format", "version", "seed", "batch", "tokens", "batch_size", "context")


def _refuse(kind: DataErrorKind, message: str, path: str | Path = "") -> DataError:
    return DataError(kind, message, path=str(path))


class TokenFile:
    """The token ids of a 1-D integer ``.npy``, read as a dataset's shards are
    (``shard_file.py``: memory-mapped under a read lease, else with pread, so a file
    truncated under a run is a ``DataError``, never a SIGBUS) and never read whole.

    ``len(tokens)`` and ``tokens[a:b]`` (a fresh array) as the 1-D array would give them;
    ``windows`` reads a batch's windows at once.

    Attributes:
      path: the file.
      dtype: the token ids' dtype as stored.
      shape: ``(number of tokens,)``.
    """

    ndim = 1

    def __init__(self, file: ShardFile, count: int, dtype: np.dtype[Any]) -> None:
        self.path = file.path
        self.dtype = dtype
        self.shape = (count,)
        self._file = file

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: slice) -> np.ndarray[Any, Any]:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise UsageError(f"A TokenFile reads slices tokens[a:b], not tokens[{key!r}].")
        start, stop, _ = key.indices(len(self))
        window: np.ndarray[Any, Any] = self.windows([start], max(0, stop - start))[0]
        return window

    def windows(self, starts: Sequence[int], width: int) -> np.ndarray[Any, Any]:
        """The ``width`` tokens from each of ``starts`` (each window inside the file),
        stacked: ``(len(starts), width)``.

        Raises:
          DataError: ``WRONG_SIZE``, the file was truncated or rewritten under the reader.
        """
        out = np.empty((len(starts), width), self.dtype)
        self._file.read_windows([int(s) for s in starts], out)
        return out

    def close(self) -> None:
        """Let the file's lease go and close it (see ``Dataset.close``)."""
        self._file.close()


def open_tokens(path: str | Path) -> TokenFile:
    """The token ids of a 1-D integer ``.npy`` (``TokenFile``: never read whole).

    Raises:
      DataError: the file is missing, not a ``.npy``, not one-dimensional or not of an
        integer dtype (``BAD_SHARD``; ``MISSING_SHARD`` for a missing file), or not the
        size its header says (``WRONG_SIZE``).
    """
    p = Path(path)
    if not p.is_file():
        kind = DataErrorKind.MISSING_SHARD if not p.exists() else DataErrorKind.BAD_SHARD
        what = "does not exist" if not p.exists() else "is not a regular file"
        raise _refuse(kind, f"The token file {str(p)!r} {what}.", p)
    try:
        shape, _, dtype, offset = read_npy_header(p)
    except (OSError, ValueError, SyntaxError) as e:
        raise _refuse(
            DataErrorKind.BAD_SHARD,
            f"The token file {str(p)!r} is not a .npy array ({e}). Write the token ids with "
            "numpy.save(path, ids), one 1-D integer array.",
            p,
        ) from None
    if len(shape) != 1 or dtype.kind not in "iu":
        raise _refuse(
            DataErrorKind.BAD_SHARD,
            f"The token file {str(p)!r} holds {dtype}{list(shape)}; a .npy is "
            "read as a token stream, one 1-D array of integer token ids (numpy.save(path, "
            "ids)). Stacked batches go in an .npz (numpy.savez(path, x=xs, y=ys)).",
            p,
        )
    size, need = p.stat().st_size, offset + shape[0] * dtype.itemsize
    if size != need:
        raise _refuse(
            DataErrorKind.WRONG_SIZE,
            f"The token file {str(p)!r} is {size} bytes; its header ({shape[0]} {dtype} "
            f"token ids) needs {need}. The file is truncated or was appended to: write it "
            "again with numpy.save(path, ids).",
            p,
        )
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError as e:
        raise _refuse(
            DataErrorKind.BAD_SHARD, f"The token file {str(p)!r} cannot be read ({e}).", p
        ) from None
    return TokenFile(
        open_shard_file(str(p), fd, size, offset, shape[0], dtype, ()), shape[0], dtype
    )


class TokenStream:
    """Batches of token windows at seeded random offsets (see the module docstring).

    Args:
      tokens: the token ids: ``open_tokens``'s ``TokenFile``, or a 1-D integer array.
      batch_size: the global batch size B (all processes together).
      context: the window length T, the bundle's sequence length.
      inputs: the batch inputs' names: one (the window) or two (the window, and the window
        shifted by one token: the targets).
      dtype: the dtype the bundle's inputs take (int64 unless told).
      seed: the sampling seed (a non-negative integer).
      process_index, process_count: this process's share of every global batch.
      state: a ``TokenStream.state()`` to continue from (same as ``set_state``).

    Raises:
      DataError: the stream is shorter than a window and its target, or the arguments do
        not fit (``BAD_ROWS``).
    """

    def __init__(
        self,
        tokens: TokenFile | np.ndarray[Any, Any],
        batch_size: int,
        context: int,
        *,
        inputs: Sequence[str] = ("x", "y"),
        dtype: Any = np.int64,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        if len(inputs) not in (1, 2):
            raise _refuse(
                DataErrorKind.BAD_ROWS,
                f"A token stream feeds one input (the window) or two (the window and its "
                f"targets), not {list(inputs)}.",
            )
        if batch_size < 1 or context < 1 or seed < 0:
            raise _refuse(
                DataErrorKind.BAD_ROWS,
                f"batch_size and context must be at least 1 and seed at least 0, got "
                f"{batch_size}, {context} and {seed}.",
            )
        if len(tokens) < context + 2:
            raise _refuse(
                DataErrorKind.BAD_ROWS,
                f"The token stream holds {len(tokens)} tokens, fewer than one window of "
                f"{context} and its target token need ({context + 2} at least).",
            )
        if batch_size % process_count:
            raise _refuse(
                DataErrorKind.BAD_ROWS,
                f"The batch of {batch_size} rows does not split over {process_count} "
                "processes; use a batch size that is a multiple of the process count.",
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.context = context
        self.inputs = tuple(inputs)
        self.dtype = np.dtype(dtype)
        self.seed = seed
        self.batch = 0
        per = batch_size // process_count
        self._rows = slice(process_index * per, (process_index + 1) * per)
        if state is not None:
            self.set_state(state)

    def offsets(self, i: int) -> np.ndarray[Any, Any]:
        """The global batch ``i``'s window offsets, all processes' rows."""
        rng = np.random.Generator(np.random.PCG64([self.seed, i]))
        return rng.integers(0, len(self.tokens) - self.context - 1, size=self.batch_size)

    def state(self) -> dict[str, Any]:
        """Where the stream stands (JSON): the next batch's index and what fixes it."""
        return {
            "format": TOKENS_FORMAT,
            "version": TOKENS_STATE_VERSION,
            "seed": self.seed,
            "batch": self.batch,
            "tokens": len(self.tokens),
            "batch_size": self.batch_size,
            "context": self.context,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (``state()`` of a stream over the same tokens).

        Raises:
          DataError: it is not a token stream's state, is of a newer version, or was
            taken over other tokens, another batch size or context (``UNSUPPORTED_VERSION``,
            ``BAD_INDEX``).
        """
        if not isinstance(state, Mapping) or state.get("format") != TOKENS_FORMAT:
            raise _refuse(
                DataErrorKind.BAD_INDEX,
                "The data position to resume from is not a token stream's (it was written "
                "by a run over another kind of data). Resume with the --data it was taken "
                "with.",
            )
        version = state.get("version")
        if not isinstance(version, int) or not 1 <= version <= TOKENS_STATE_VERSION:
            raise _refuse(
                DataErrorKind.UNSUPPORTED_VERSION,
                f"The token stream position has version {version!r}; this reader reads "
                f"versions 1 to {TOKENS_STATE_VERSION}. Upgrade stepbundle.",
            )
        missing = [k for k in _STATE_KEYS if not isinstance(state.get(k), (int, str))]
        if missing:
            raise _refuse(
                DataErrorKind.BAD_INDEX, f"The token stream position lacks {', '.join(missing)}."
            )
        mine = self.state()
        differs = [
            f"{k} {state[k]} (now {mine[k]})"
            for k in ("tokens", "batch_size", "context")
            if state[k] != mine[k]
        ]
        if differs:
            raise _refuse(
                DataErrorKind.BAD_INDEX,
                "The run being resumed read other token data: " + ", ".join(differs) + ". "
                "Resume with the same --data and batch size.",
            )
        self.seed = int(state["seed"])
        self.batch = int(state["batch"])

    def __iter__(self) -> Iterator[dict[str, np.ndarray[Any, Any]]]:
        return self

    def __next__(self) -> dict[str, np.ndarray[Any, Any]]:
        starts = self.offsets(self.batch)[self._rows]
        self.batch += 1
        width = self.context + (1 if len(self.inputs) == 2 else 0)
        if isinstance(self.tokens, TokenFile):
            rows = self.tokens.windows(starts.tolist(), width)
        else:
            rows = np.stack([np.asarray(self.tokens[s : s + width]) for s in starts])
        rows = rows.astype(self.dtype, copy=False)
        if len(self.inputs) == 1:
            return {self.inputs[0]: rows}
        return {self.inputs[0]: rows[:, :-1], self.inputs[1]: rows[:, 1:]}
