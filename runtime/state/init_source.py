"""Where a run's initial state is read from: one safetensors file, or a Hugging Face
sharded checkpoint (``model.safetensors.index.json`` and its shards), by name.

``open_source(path)`` accepts what PyTorch and the Hugging Face tools write:

- a ``.safetensors`` file: ``safetensors.torch.save_file(model.state_dict(), ...)``, a
  ``save_pretrained`` of a small model, or a checkpoint the runtime wrote
  (``save_checkpoint``, ``--save-state``: its metadata is ignored here, its tensors used);
- a ``*.safetensors.index.json``: ``save_pretrained(max_shard_size=...)``'s index, whose
  ``weight_map`` names the shard file of every tensor (shards lie beside the index);
- a folder holding ``model.safetensors.index.json`` or ``model.safetensors`` (what
  ``save_pretrained`` writes);
- any of these at a URL (``https://``, ``gs://``, ... through ``remote.py``): the file,
  or the index and every shard it names, is downloaded into a temporary folder, mapped,
  and the copies unlinked at once (the maps keep them readable until closed).

Every file is memory-mapped and its header checked (``tensor_file.py``); nothing is
read beyond the headers until the state is placed.

Imports: numpy, stepbundle.schema, this package's ``remote`` (fsspec, for URLs).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import CheckpointError
from ..io import remote
from ..io.file_kinds import kind_of
from ..io.tensor_file import MAX_HEADER, SafetensorsFile, TensorRecord, open_safetensors

__all__ = ["INDEX_NAME", "SINGLE_NAME", "InitSource", "open_source"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass
class InitSource:
    """The open files of a checkpoint and where each of its tensors lies.

    Attributes:
      path: what was given (a file, an index or a folder; a URL as its text).
      tensors: every tensor name -> its file and record; for an index, the names of its
        ``weight_map``.
    """

    path: Path | str
    tensors: dict[str, tuple[SafetensorsFile, TensorRecord]]
    _files: tuple[SafetensorsFile, ...]

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> InitSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve(p: Path) -> Path:
    """The file to read for ``p``: ``p`` itself, or the checkpoint inside a folder."""
    if not p.exists():
        raise CheckpointError(
            f"The initial-state checkpoint {str(p)!r} does not exist. Give a .safetensors "
            f"file, a {INDEX_NAME} or the folder save_pretrained wrote."
        )
    if p.is_dir():
        for name in (INDEX_NAME, SINGLE_NAME):
            if (p / name).is_file():
                return p / name
        for name in (INDEX_NAME, SINGLE_NAME):
            try:
                mode = (p / name).stat().st_mode  # there, but no file: never opened
            except OSError:
                continue
            raise CheckpointError(
                f"The folder {str(p)!r} holds {name}, but it is {kind_of(mode)}, not a "
                "regular file (a pipe would block the run, a device read without end). "
                "Put the checkpoint file itself there, or give its path."
            )
        found = sorted(q.name for q in p.glob("*.safetensors*"))[:5]
        raise CheckpointError(
            f"The folder {str(p)!r} holds neither {INDEX_NAME} nor {SINGLE_NAME} "
            f"(safetensors files there: {', '.join(found) or 'none'}). Give the file itself."
        )
    return p


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a Hugging Face index: tensor name -> shard file name."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(
            f"{index} is not a safetensors index of a sharded checkpoint: {why}. Give the "
            "model.safetensors.index.json that save_pretrained wrote, or a .safetensors file."
        )

    try:
        if index.stat().st_size > MAX_HEADER:
            raise bad(f"it is larger than {MAX_HEADER} bytes")
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise bad('it has no "weight_map" object of tensor name -> shard file name')
    for shard in set(weight_map.values()):
        parts = PurePosixPath(shard).parts
        # Shards lie beside their index; a name reaching elsewhere is not a shard of it.
        if not parts or PurePosixPath(shard).is_absolute() or ".." in parts or "\\" in shard:
            raise bad(f"the shard name {shard!r} does not name a file beside the index")
    return dict(weight_map)


def open_source(path: str | os.PathLike[str]) -> InitSource:
    """Open the checkpoint at ``path`` (a file, an index, or a folder; see the module).

    Raises:
      CheckpointError: nothing to read there, or a file or the index is malformed, or
        the index names a tensor its shard does not hold.
    """
    local = remote.local_path(path)  # a path, or a file:// URL's path
    if local is None:
        return _open_remote(os.fspath(path))
    given = local
    target = _resolve(given)
    if not target.name.endswith(".json"):
        f = open_safetensors(target)
        return InitSource(given, {n: (f, r) for n, r in f.records.items()}, (f,))
    weight_map = _read_index(target)
    files: dict[str, SafetensorsFile] = {}
    try:
        for shard in sorted(set(weight_map.values())):
            shard_path = target.parent / shard
            if not shard_path.is_file():
                raise CheckpointError(
                    f"{target} names the shard {shard!r}, which is not in {str(target.parent)!r}. "
                    "Copy every shard of the checkpoint beside its index."
                )
            files[shard] = open_safetensors(shard_path)
        tensors: dict[str, tuple[SafetensorsFile, TensorRecord]] = {}
        for name, shard in weight_map.items():
            record = files[shard].records.get(name)
            if record is None:
                raise CheckpointError(
                    f"{target} says tensor {name!r} is in the shard {shard!r}, which does not "
                    "hold it: the index and its shards are from different saves. Save the "
                    "checkpoint again."
                )
            tensors[name] = (files[shard], record)
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return InitSource(given, tensors, tuple(files.values()))


def _fetch(url: str, to: Path) -> None:
    try:
        with remote.downloaded(url) as copy:
            shutil.move(copy, to)
    except FileNotFoundError:
        raise CheckpointError(
            f"The initial-state checkpoint {url!r} does not exist. Give the URL of a "
            f".safetensors file or of a {INDEX_NAME}."
        ) from None
    except remote.RemoteError as e:  # its message is a whole sentence naming the URL
        raise CheckpointError(f"Cannot read the initial-state checkpoint {url}: {e}") from None
    except OSError as e:
        raise CheckpointError(f"Cannot read the initial-state checkpoint {url}: {e}.") from None


def _open_remote(url: str) -> InitSource:
    """``open_source`` of a URL: a file, or an index with its shards beside it."""
    folder = Path(tempfile.mkdtemp(prefix=".stepbundle-init-"))
    try:
        name = url.rstrip("/").rpartition("/")[2] or SINGLE_NAME
        local = folder / name
        _fetch(url, local)
        if name.endswith(".json"):
            base = url.rstrip("/").rpartition("/")[0]
            for shard in sorted(set(_read_index(local).values())):
                (folder / shard).parent.mkdir(parents=True, exist_ok=True)
                _fetch(remote.join(base, shard), folder / shard)
        try:
            opened = open_source(local)
        except CheckpointError as e:  # it names the temporary copies: name the URLs
            base = url.rstrip("/").rpartition("/")[0]
            message = str(e).replace(str(local), url).replace(str(folder), base)
            raise CheckpointError(message) from None
        opened.path = url  # messages name what the user gave, not the temporary copy
        return opened
    finally:
        shutil.rmtree(folder, ignore_errors=True)
