"""The on-disk dataset (runtime/data/dataset.py, dataset_writer.py) and its loader (loader.py).

numpy only (no jax program runs): these tests also run in the lean environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from runtime_helpers import lease_granted

from stepbundle.runtime.data.dataset import (
    INDEX_NAME,
    DataError,
    DataErrorKind,
    Dataset,
    iter_rows,
    open_dataset,
    shard_file_name,
)
from stepbundle.runtime.data.dataset_writer import DatasetWriter, write_dataset
from stepbundle.runtime.data.loader import LastBatch, Loader, LoaderState
from stepbundle.schema.errors import BundleError, StepbundleError, UsageError

Batch = dict[str, np.ndarray[Any, Any]]


def make_arrays(rows: int) -> Batch:
    """Rows whose content names their row: x[i] = (i, i+0.5, ...), y[i] = i."""
    x = np.arange(rows, dtype=np.float32)[:, None] + np.arange(3, dtype=np.float32) * 0.5
    return {"x": x.reshape(rows, 3, 1), "y": np.arange(rows, dtype=np.int64)}


@pytest.fixture
def ds(tmp_path: Path) -> Dataset:
    """103 rows in shards of 10 (the last one 3 rows): batches cross shard borders."""
    return write_dataset(tmp_path / "ds", make_arrays(103), rows_per_shard=10)


def take(loader: Loader, k: int) -> list[Batch]:
    return [next(loader) for _ in range(k)]


def assert_batches_equal(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for p, q in zip(a, b, strict=True):
        assert p.keys() == q.keys()
        for k in p:
            np.testing.assert_array_equal(p[k], q[k])


# -- writing and reading ---------------------------------------------------------------


def test_round_trip_stacked(ds: Dataset, tmp_path: Path) -> None:
    want = make_arrays(103)
    assert ds.rows == 103
    assert ds.shard_rows == (10,) * 10 + (3,)
    assert [(s.name, s.dtype.name, s.shape) for s in ds.inputs] == [
        ("x", "float32", (3, 1)),
        ("y", "int64", ()),
    ]
    got = ds.gather(np.arange(103))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    # Any order, repeats, across shards.
    idx = np.array([102, 0, 55, 55, 9, 10, 101])
    got = ds.gather(idx)
    np.testing.assert_array_equal(got["y"], idx)
    np.testing.assert_array_equal(got["x"], want["x"][idx])
    # Shards are plain .npy files numpy reads alone, without pickle.
    plain = np.load(tmp_path / "ds" / shard_file_name("x", 3), allow_pickle=False)
    np.testing.assert_array_equal(plain, want["x"][30:40])
    index = json.loads((tmp_path / "ds" / INDEX_NAME).read_text())
    assert index["rows"] == 103 and len(index["shards"]) == 11
    chunks = list(iter_rows(ds, chunk_rows=40))
    np.testing.assert_array_equal(np.concatenate([c["y"] for c in chunks]), np.arange(103))


def test_round_trip_rows_and_chunks(tmp_path: Path) -> None:
    want = make_arrays(25)
    rows = ({"x": want["x"][i], "y": want["y"][i]} for i in range(25))
    a = write_dataset(tmp_path / "rows", rows, rows_per_shard=7)
    chunks = ({k: v[i : i + 4] for k, v in want.items()} for i in range(0, 25, 4))
    b = write_dataset(tmp_path / "chunks", chunks, rows_per_shard=7, stacked=True)
    for d in (a, b):
        assert d.shard_rows == (7, 7, 7, 4)
        got = d.gather(np.arange(25))
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_shards_are_memory_mapped_and_gather_copies(ds: Dataset) -> None:
    # Where a lease is granted (Linux, the file's owner) rows come from the memory maps.
    mapped = {f.mapped for files in ds.files.values() for f in files}
    assert mapped == {lease_granted(Path(ds.path))}, mapped
    got = ds.gather(np.array([3, 4]))
    got["y"][:] = -1  # a fresh array: writing it changes nothing on disk
    np.testing.assert_array_equal(ds.gather(np.array([3, 4]))["y"], [3, 4])
    with pytest.raises(IndexError):
        ds.gather(np.array([103]))
    ds.close()  # lets the leases go; the dataset cannot be read any more
    assert not any(f.mapped for files in ds.files.values() for f in files)
    with pytest.raises(UsageError, match="was closed"):
        ds.gather(np.array([3]))


def test_writer_refusals(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "other.txt").write_text("x")
    with pytest.raises(DataError, match="not an empty folder") as e:
        write_dataset(tmp_path / "full", make_arrays(3))
    assert e.value.kind is DataErrorKind.OUTPUT_EXISTS
    rows = [{"x": np.zeros(2, np.float32)}, {"x": np.zeros(3, np.float32)}]
    with pytest.raises(DataError, match="Every row must have the same dtype and shape") as e:
        write_dataset(tmp_path / "shape", rows)
    assert e.value.kind is DataErrorKind.BAD_ROWS
    # The failed write left no index: the folder is not a dataset.
    with pytest.raises(DataError) as e:
        open_dataset(tmp_path / "shape")
    assert e.value.kind is DataErrorKind.MISSING_INDEX
    with pytest.raises(DataError, match="cannot hold") as e:
        write_dataset(tmp_path / "obj", {"x": np.array([1 + 2j, 3j])})
    assert e.value.kind is DataErrorKind.UNKNOWN_DTYPE
    with pytest.raises(DataError, match="cannot name shard files"):
        write_dataset(tmp_path / "name", {"a/b": np.zeros(3)})
    with pytest.raises(DataError, match="same number of rows"):
        write_dataset(tmp_path / "n", {"x": np.zeros(3), "y": np.zeros(4)})
    with pytest.raises(DataError, match="No rows were written"):
        write_dataset(tmp_path / "empty", iter([]))


def test_writer_streams_one_shard_at_a_time(tmp_path: Path) -> None:
    w = DatasetWriter(tmp_path / "d", rows_per_shard=4)
    for i in range(9):
        w.append({"v": np.full(2, i, np.int32)})
        # A shard file appears as soon as it is full; the index only at the end.
        assert len(list((tmp_path / "d").glob("v-*.npy"))) == (i + 1) // 4
    assert not (tmp_path / "d" / INDEX_NAME).exists()
    w.close()
    assert open_dataset(tmp_path / "d").shard_rows == (4, 4, 1)


# -- index validation ------------------------------------------------------------------


def edit_index(folder: Path, **changes: Any) -> None:
    index = json.loads((folder / INDEX_NAME).read_text())
    index.update(changes)
    (folder / INDEX_NAME).write_text(json.dumps(index))


def refused(folder: Path, kind: DataErrorKind, *phrases: str) -> DataError:
    with pytest.raises(DataError) as e:
        open_dataset(folder)
    assert e.value.kind is kind, str(e.value)
    for p in phrases:
        assert p in str(e.value), str(e.value)
    assert isinstance(e.value, StepbundleError) and not isinstance(e.value, BundleError)
    return e.value


def test_refuses_missing_index(tmp_path: Path) -> None:
    refused(tmp_path, DataErrorKind.MISSING_INDEX, "has no dataset.json", "write_dataset")
    refused(tmp_path / "nope", DataErrorKind.MISSING_INDEX, "not a folder")


def test_refuses_bad_json(ds: Dataset) -> None:
    folder = Path(ds.path)
    (folder / INDEX_NAME).write_text('{"format": "stepbundle.dataset", ')
    e = refused(folder, DataErrorKind.BAD_INDEX, "is not valid JSON", "Rewrite the dataset")
    assert e.path == str(folder / INDEX_NAME)
    (folder / INDEX_NAME).write_text("[1, 2]")
    refused(folder, DataErrorKind.BAD_INDEX, "is not a JSON object")


def test_refuses_unknown_dtype(ds: Dataset) -> None:
    folder = Path(ds.path)
    edit_index(folder, inputs={"x": {"dtype": "complex64", "shape": [3, 1]}})
    refused(folder, DataErrorKind.UNKNOWN_DTYPE, "'complex64'", "which is not one of")


def test_refuses_mismatched_row_counts(ds: Dataset) -> None:
    folder = Path(ds.path)
    edit_index(folder, rows=104)
    refused(folder, DataErrorKind.ROW_COUNT, "says rows=104", "hold 103 rows")


def test_refuses_missing_shard(ds: Dataset) -> None:
    folder = Path(ds.path)
    (folder / shard_file_name("y", 4)).unlink()
    e = refused(folder, DataErrorKind.MISSING_SHARD, "shard 4 of input 'y'", "'y-00004.npy'")
    assert e.path == str(folder / "y-00004.npy")


def test_refuses_wrong_size(ds: Dataset) -> None:
    folder = Path(ds.path)
    ds.close()  # else writing a shard in place waits for this process's own lease
    shard = folder / shard_file_name("x", 2)
    data = shard.read_bytes()
    shard.write_bytes(data[:-4])
    refused(folder, DataErrorKind.WRONG_SIZE, f"is {len(data) - 4} bytes", "truncated")
    shard.write_bytes(data + b"\0" * 8)
    refused(folder, DataErrorKind.WRONG_SIZE, f"need {len(data)}")


def test_refuses_shard_of_other_dtype_or_shape(ds: Dataset) -> None:
    folder = Path(ds.path)
    ds.close()  # else writing a shard in place waits for this process's own lease
    np.save(folder / shard_file_name("y", 0), np.arange(10, dtype=np.int32))
    refused(folder, DataErrorKind.BAD_SHARD, "'<i4'", "int64")
    np.save(folder / shard_file_name("y", 0), np.arange(11, dtype=np.int64))
    refused(folder, DataErrorKind.BAD_SHARD, "shape (11,)", "(10,)")
    (folder / shard_file_name("y", 0)).write_bytes(b"not numpy at all")
    refused(folder, DataErrorKind.BAD_SHARD, "not a readable .npy file")


def test_refuses_other_format_newer_version_and_extra_keys(ds: Dataset) -> None:
    folder = Path(ds.path)
    edit_index(folder, version=2)
    refused(folder, DataErrorKind.UNSUPPORTED_VERSION, "dataset version 2", "up to 1")
    edit_index(folder, version=1, format="other")
    refused(folder, DataErrorKind.UNSUPPORTED_VERSION, "not a stepbundle dataset")
    edit_index(folder, format="stepbundle.dataset", extra=1)
    refused(folder, DataErrorKind.BAD_INDEX, "unexpected ['extra']")
    index = json.loads((folder / INDEX_NAME).read_text())
    del index["extra"]
    index["shards"][0] = {"rows": 0}
    (folder / INDEX_NAME).write_text(json.dumps(index))
    refused(folder, DataErrorKind.BAD_INDEX, "lists shard 0")


# -- the loader ------------------------------------------------------------------------


def test_every_row_once_per_epoch_and_fresh_order_each_epoch(ds: Dataset) -> None:
    loader = Loader(ds, 8, seed=5, last_batch="keep")
    assert loader.batches_per_epoch == 13
    epochs = [np.concatenate([b["y"] for b in take(loader, 13)]) for _ in range(3)]
    for e in epochs:
        np.testing.assert_array_equal(np.sort(e), np.arange(103))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])
    # Rows stay whole: x follows y.
    b = Loader(ds, 8, seed=5).__next__()
    np.testing.assert_array_equal(b["x"][:, 0, 0], b["y"].astype(np.float32))


def test_deterministic_by_seed(ds: Dataset) -> None:
    a = take(Loader(ds, 16, seed=1), 20)
    b = take(Loader(ds, 16, seed=1), 20)
    assert_batches_equal(a, b)
    c = take(Loader(ds, 16, seed=2), 20)
    assert not all(np.array_equal(p["y"], q["y"]) for p, q in zip(a, c, strict=True))
    in_order = take(Loader(ds, 16, shuffle=False), 2)
    np.testing.assert_array_equal(in_order[1]["y"], np.arange(16, 32))


@pytest.mark.parametrize("last", ["drop", "keep", "pad"])
def test_exact_resume_across_an_epoch_boundary(ds: Dataset, last: str) -> None:
    def make(**kw: Any) -> Loader:
        return Loader(ds, 8, seed=7, last_batch=last, mask_key="mask", **kw)

    per_epoch = make().batches_per_epoch
    uninterrupted = take(make(), 2 * per_epoch + 3)
    for k in (per_epoch - 1, per_epoch, per_epoch + 1):
        first = make()
        take(first, k)
        state = json.loads(json.dumps(first.state()))  # what a checkpoint stores
        resumed = make(state=state)
        assert_batches_equal(take(resumed, per_epoch + 2), uninterrupted[k : k + per_epoch + 2])
        again = make()
        again.set_state(state)
        assert again.state() == state


def test_state_format(ds: Dataset) -> None:
    loader = Loader(ds, 8, seed=3, last_batch="pad")
    take(loader, 14)
    assert loader.state() == {
        "format": "stepbundle.loader",
        "version": 1,
        "seed": 3,
        "epoch": 1,
        "batch_in_epoch": 1,
        "rows": 103,
        "batch_size": 8,
        "shuffle": True,
        "last_batch": "pad",
    }
    assert LoaderState.from_json(loader.state()) == loader.loader_state()


def test_state_refusals(ds: Dataset) -> None:
    state = Loader(ds, 8, seed=3).state()
    with pytest.raises(DataError, match="seed 3 \\(saved\\) vs 4 \\(this loader\\)") as e:
        Loader(ds, 8, seed=4, state=state)
    assert e.value.kind is DataErrorKind.BAD_STATE
    with pytest.raises(DataError, match="batch_size 8 \\(saved\\) vs 16"):
        Loader(ds, 16, seed=3, state=state)
    with pytest.raises(DataError, match="last_batch"):
        Loader(ds, 8, seed=3, last_batch="pad", state=state)
    with pytest.raises(DataError, match="expected a non-negative integer"):
        Loader(ds, 8, seed=3, state={**state, "epoch": -1})
    with pytest.raises(DataError, match="an epoch has 12 batches"):
        Loader(ds, 8, seed=3, state={**state, "batch_in_epoch": 12})
    with pytest.raises(DataError, match="versions 1 to 1"):
        Loader(ds, 8, seed=3, state={**state, "version": 2})
    with pytest.raises(DataError, match="exactly the keys"):
        Loader(ds, 8, seed=3, state={k: v for k, v in state.items() if k != "rows"})


def test_last_batch_drop_keep_pad(ds: Dataset) -> None:
    drop = take(Loader(ds, 8, shuffle=False, last_batch="drop"), 13)
    assert [len(b["y"]) for b in drop] == [8] * 13  # 12 full batches, then epoch 1
    np.testing.assert_array_equal(drop[12]["y"], np.arange(8))

    keep = take(Loader(ds, 8, shuffle=False, last_batch=LastBatch.KEEP), 13)
    assert [len(b["y"]) for b in keep] == [8] * 12 + [7]
    np.testing.assert_array_equal(keep[12]["y"], np.arange(96, 103))
    assert "mask" not in keep[12]  # no mask unless asked for

    pad = take(Loader(ds, 8, shuffle=False, last_batch="pad", mask_key="mask"), 14)
    assert [len(b["y"]) for b in pad] == [8] * 14
    np.testing.assert_array_equal(pad[12]["y"], [96, 97, 98, 99, 100, 101, 102, 96])
    np.testing.assert_array_equal(pad[12]["mask"], [True] * 7 + [False])
    assert pad[0]["mask"].dtype == np.bool_ and pad[0]["mask"].all()
    np.testing.assert_array_equal(pad[13]["y"], np.arange(8))  # the next epoch
    real = np.concatenate([b["y"][b["mask"]] for b in pad[:13]])
    np.testing.assert_array_equal(real, np.arange(103))


def test_epochs_limit(ds: Dataset) -> None:
    loader = Loader(ds, 10, epochs=2, last_batch="keep")
    batches = list(loader)
    assert len(batches) == 22 and loader.exhausted
    with pytest.raises(StopIteration):
        next(loader)


@pytest.mark.parametrize("last", ["drop", "pad"])
def test_two_processes_read_disjoint_slices_of_each_global_batch(ds: Dataset, last: str) -> None:
    def make(p: int, n: int) -> Loader:
        return Loader(
            ds, 8, seed=9, last_batch=last, mask_key="m", process_index=p, process_count=n
        )

    steps = 2 * make(0, 1).batches_per_epoch + 1
    one = take(make(0, 1), steps)
    p0, p1 = take(make(0, 2), steps), take(make(1, 2), steps)
    for whole, a, b in zip(one, p0, p1, strict=True):
        assert len(a["y"]) == len(b["y"]) == 4
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([a[k], b[k]]), whole[k])
        real_a, real_b = a["y"][a["m"]], b["y"][b["m"]]
        assert not set(real_a.tolist()) & set(real_b.tolist())


def test_two_processes_read_only_their_rows(ds: Dataset) -> None:
    seen: list[np.ndarray[Any, Any]] = []
    gather = ds.gather

    class Spy(Dataset):
        pass

    spy = Spy(**{f: getattr(ds, f) for f in ds.__dataclass_fields__})
    object.__setattr__(spy, "gather", lambda idx: (seen.append(np.array(idx)), gather(idx))[1])
    take(Loader(spy, 8, seed=1, process_index=1, process_count=2), 3)
    assert [len(s) for s in seen] == [4, 4, 4]


def test_loader_refusals(ds: Dataset) -> None:
    with pytest.raises(DataError, match="does not split evenly over 3 processes"):
        Loader(ds, 8, process_count=3)
    with pytest.raises(DataError, match="leaves a last batch of 7 rows"):
        Loader(ds, 8, last_batch="keep", process_count=2)
    with pytest.raises(DataError, match="fewer than one batch"):
        Loader(ds, 200)
    with pytest.raises(DataError, match="also an input"):
        Loader(ds, 8, mask_key="y")
    with pytest.raises(DataError, match="last_batch must be one of"):
        Loader(ds, 8, last_batch="repeat")
    with pytest.raises(DataError, match="process_index must lie in"):
        Loader(ds, 8, process_index=2, process_count=2)


# -- memory ----------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from stepbundle.runtime.data.dataset import open_dataset
    from stepbundle.runtime.data.loader import Loader

    def vm_data():
        for line in open("/proc/self/status"):
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024

    path, mode, headroom = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cap = vm_data() + headroom  # everything imported so far, plus the headroom
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    ds = open_dataset(path)
    if mode == "whole":  # the control: reading the dataset into memory must fail
        try:
            whole = ds.gather(np.arange(ds.rows))
        except MemoryError:
            print("MemoryError")
            sys.exit(0)
        print("loaded whole", sum(v.nbytes for v in whole.values()))
        sys.exit(1)
    seen = 0
    total = 0
    for batch in Loader(ds, 256, seed=0, epochs=1, last_batch="keep"):
        seen += len(batch["y"])
        total += int(batch["y"].sum())
    assert seen == ds.rows and total == ds.rows * (ds.rows - 1) // 2, (seen, total)
    print("ok", seen, (vm_data() - cap + headroom) // 2**20, "MiB data")
    """
)


def test_iterates_a_dataset_larger_than_the_memory_cap(tmp_path: Path) -> None:
    """RLIMIT_DATA counts private writable memory, not read-only file maps: a child
    capped at 96 MiB above its imports reads every row of a ~400 MB dataset, and the
    same child reading the dataset whole into memory fails under the same cap."""
    rows, per_chunk = 130_000, 10_000  # 130k rows x (3072 + 8) bytes ~ 400 MB
    folder = tmp_path / "big"

    def chunks() -> Any:
        for start in range(0, rows, per_chunk):
            n = min(per_chunk, rows - start)
            x = np.empty((n, 32, 32, 3), dtype=np.uint8)
            x[:] = (np.arange(start, start + n) % 251).astype(np.uint8)[:, None, None, None]
            yield {"x": x, "y": np.arange(start, start + n, dtype=np.int64)}

    write_dataset(folder, chunks(), stacked=True, rows_per_shard=20_000)
    size = sum(f.stat().st_size for f in folder.iterdir())
    headroom = 96 * 2**20
    assert size > 3 * headroom
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def child(mode: str) -> str:
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, str(folder), mode, str(headroom)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    assert child("whole").startswith("MemoryError")
    out = child("loader")
    assert out.startswith(f"ok {rows}"), out
