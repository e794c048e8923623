"""A token stream (``--data tokens.npy``): windows of the bundle's context cut from one
array of token ids at seeded random offsets, resumable (issue #43, item 12)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import cli_here

from stepbundle.runtime.data.dataset_index import DataError, DataErrorKind
from stepbundle.runtime.data.tokens import TokenStream, open_tokens
from stepbundle.runtime.state.checkpoint import read_safetensors

HERE = Path(__file__).resolve().parent
BUNDLE = HERE / "data" / "sdpa_composite.stepbundle"  # a tiny GPT: idx, y: i64[2, 8]


def _tokens(tmp_path: Path, n: int = 500, dtype: str = "uint16") -> Path:
    path = tmp_path / "tokens.npy"
    np.save(path, (np.arange(n) * 7919 % 16).astype(dtype))  # the tiny GPT's vocabulary: 16
    return path


def test_windows_are_slices_of_the_stream_and_targets_are_shifted(tmp_path: Path) -> None:
    tokens = open_tokens(_tokens(tmp_path))
    plain = np.load(_tokens(tmp_path))  # the file as numpy reads it
    assert len(tokens) == 500 and tokens.dtype == np.uint16
    assert tokens[:].tolist() == plain.tolist() and tokens[490:600].tolist() == plain[490:].tolist()
    stream = TokenStream(tokens, 4, 8, inputs=("idx", "y"), seed=3)
    for i in range(3):
        starts = stream.offsets(i)
        batch = next(stream)
        assert batch["idx"].dtype == np.int64 and batch["idx"].shape == (4, 8)
        for row, s in enumerate(starts):
            assert batch["idx"][row].tolist() == tokens[s : s + 8].tolist()
            assert batch["y"][row].tolist() == tokens[s + 1 : s + 9].tolist()
    # one input: the window alone (Hugging Face's input_ids, labels made in the model)
    (only,) = next(TokenStream(tokens, 2, 8, inputs=("input_ids",))).values()
    assert only.shape == (2, 8)


def test_a_resumed_stream_draws_the_batches_the_uninterrupted_one_draws(tmp_path: Path) -> None:
    tokens = open_tokens(_tokens(tmp_path))
    straight = TokenStream(tokens, 4, 8, seed=11)
    whole = [next(straight) for _ in range(5)]
    first = TokenStream(tokens, 4, 8, seed=11)
    for _ in range(2):
        next(first)
    resumed = TokenStream(tokens, 4, 8, seed=0, state=first.state())  # the seed comes back
    for want in whole[2:]:
        got = next(resumed)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    other_seed = next(TokenStream(tokens, 4, 8, seed=12))
    assert not np.array_equal(other_seed["x"], whole[0]["x"])


def test_processes_read_their_rows_of_every_global_batch(tmp_path: Path) -> None:
    tokens = open_tokens(_tokens(tmp_path))
    whole = next(TokenStream(tokens, 4, 8, seed=5))
    halves = [
        next(TokenStream(tokens, 4, 8, seed=5, process_index=p, process_count=2)) for p in (0, 1)
    ]
    assert np.array_equal(np.concatenate([h["x"] for h in halves]), whole["x"])


def test_bad_token_data_is_refused_in_words(tmp_path: Path) -> None:
    np.save(tmp_path / "2d.npy", np.zeros((4, 8), np.int32))
    np.save(tmp_path / "float.npy", np.zeros(100, np.float32))
    for name, words in (("2d.npy", "1-D array of integer"), ("float.npy", "1-D array of integer")):
        with pytest.raises(DataError, match=words) as err:
            open_tokens(tmp_path / name)
        assert err.value.kind is DataErrorKind.BAD_SHARD
    with pytest.raises(DataError, match="does not exist"):
        open_tokens(tmp_path / "missing.npy")
    whole = _tokens(tmp_path).read_bytes()
    (tmp_path / "short.npy").write_bytes(whole[:-2])
    with pytest.raises(DataError, match="is truncated or was appended to") as err:
        open_tokens(tmp_path / "short.npy")
    assert err.value.kind is DataErrorKind.WRONG_SIZE
    with pytest.raises(DataError, match="fewer than one window"):
        TokenStream(open_tokens(_tokens(tmp_path, n=9)), 2, 8)
    tokens = open_tokens(_tokens(tmp_path))
    state = TokenStream(tokens, 4, 8).state()
    with pytest.raises(DataError, match="context 8 \\(now 16\\)"):
        TokenStream(tokens, 4, 16, state=state)
    with pytest.raises(DataError, match="not a token stream's"):
        TokenStream(tokens, 4, 8, state={"format": "stepbundle.loader", "version": 1})


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """``stepbundle run BUNDLE --json ARGS`` in this process (``cli_here``: the same main,
    without a child's seconds of importing jax); the refusal below runs in a child."""
    return cli_here("run", str(BUNDLE), "--json", *args)


def test_run_trains_from_a_token_file_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    data = str(_tokens(tmp_path, n=2000, dtype="int32"))
    straight = _run(
        "--data", data, "--until-step", "4", "--save-state", str(tmp_path / "a.safetensors")
    )
    assert straight.returncode == 0, straight.stderr
    half = _run(
        "--data", data, "--until-step", "2",
        "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
    )  # fmt: skip
    assert half.returncode == 0, half.stderr
    rest = _run(
        "--data", data, "--until-step", "4", "--resume", str(tmp_path / "ck"),
        "--save-state", str(tmp_path / "b.safetensors"),
    )  # fmt: skip
    assert rest.returncode == 0, rest.stderr
    losses = [json.loads(line)["loss"] for line in (straight.stdout + rest.stdout).splitlines()]
    assert len(losses) == 6 and all(isinstance(x, float) and x == x for x in losses), losses
    a = read_safetensors(tmp_path / "a.safetensors")[0]
    b = read_safetensors(tmp_path / "b.safetensors")[0]
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # another seed draws other windows, so the training goes elsewhere
    other = _run(
        "--data", data, "--until-step", "4", "--shuffle-seed", "9",
        "--save-state", str(tmp_path / "c.safetensors"),
    )  # fmt: skip
    assert other.returncode == 0, other.stderr
    c = read_safetensors(tmp_path / "c.safetensors")[0]
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_run_refuses_a_token_file_for_a_bundle_that_takes_no_tokens(tmp_path: Path) -> None:
    golden = HERE.parent / "golden" / "v1.2" / "linear_adamw.stepbundle"
    out = subprocess.run(
        [sys.executable, "-m", "stepbundle", "run", str(golden),
         "--data", str(_tokens(tmp_path)), "--steps", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "is a token stream" in out.stderr and "x: f32[8, 5]" in out.stderr
