"""atomic_write: umask permissions, no temp file left behind, the old file kept on failure."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from stepbundle.schema import atomic, atomic_write
from stepbundle.schema.atomic import atomic_write as atomic_write_itself

assert atomic_write is atomic_write_itself


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002, 0o077])
def test_the_file_gets_the_umask_permissions(tmp_path: Path, umask: None, mask: int) -> None:
    os.umask(mask)
    target = tmp_path / "f.bin"
    atomic_write(target, [b"abc"])
    assert _mode(target) == 0o666 & ~mask
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"abc")
    assert _mode(target) == _mode(plain)  # what open(path, "w") would give


def test_mode_sets_the_bits(tmp_path: Path, umask: None) -> None:
    target = tmp_path / "f.bin"
    atomic_write(target, [b"abc"], mode=0o640)
    assert _mode(target) == 0o640


def test_chunks_and_write_functions(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    atomic_write(target, [b"ab", bytearray(b"cd"), memoryview(b"ef")])
    assert target.read_bytes() == b"abcdef"

    def write(f: BinaryIO) -> None:
        f.write(b"new ")
        f.write(b"content")

    atomic_write(str(target), write)
    assert target.read_bytes() == b"new content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_bytes_alone_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"pass \[data\]"):
        atomic_write(tmp_path / "f.bin", b"abc")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_a_failing_writer_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def failing(f: BinaryIO) -> None:
        f.write(b"half of the new")
        raise RuntimeError("the writer broke")

    with pytest.raises(RuntimeError, match="the writer broke"):
        atomic_write(target, failing)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]

    def chunks() -> Iterator[bytes]:
        yield b"first"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, chunks())
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_a_failed_rename_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="Input/output"):
        atomic_write(target, [b"new"])
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_the_temp_file_is_in_the_same_folder_and_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        seen.append((src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    atomic_write(tmp_path / "f.bin", [b"x"])
    ((src, dst),) = seen
    assert os.path.dirname(src) == str(tmp_path) == os.path.dirname(dst)
    assert os.path.basename(src).startswith(f".f.bin.tmp-{atomic._HOST}-{os.getpid()}-")


def test_the_folder_must_exist(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "f.bin", [b"x"])
    assert list(tmp_path.iterdir()) == []


def test_a_check_sees_the_finished_file_and_can_refuse_it(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    seen: list[bytes] = []

    def refuse(temp: str) -> None:
        seen.append(Path(temp).read_bytes())
        raise ValueError("not good enough")

    with pytest.raises(ValueError, match="not good enough"):
        atomic_write(target, [b"new ", b"content"], check=refuse)
    assert seen == [b"new content"]  # complete, before the rename
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]  # temp removed
    atomic_write(target, [b"new"], check=lambda temp: seen.append(Path(temp).read_bytes()))
    assert target.read_bytes() == b"new" and seen[-1] == b"new"
