"""The initial state of a run: from the bundle, by rule, or from a checkpoint file.

Each state entry's section says what the bundle holds for it (format 1.1): its value
(``tensor``: stored), one element repeated over its shape (``fill``: by rule, such as a
fresh optimizer's zero moments) or nothing (``external``: it must come from a file).
``StateOptions(init_from=CKPT)`` takes the tensors ``CKPT`` holds (``init_source.py``) in
place of the bundle's, by state name or alias.

``plan_initial_state`` decides, for every entry, where its value comes from, and checks
every name, dtype and shape against the state table before anything is read or placed
on a device; each kind of mismatch has its error type. ``place_state`` then builds the
trainer's device buffers one at a time: a tensor goes from the mapped file to the device,
and its pages are released before the next one is read, so the host holds about one
tensor at a time (a pack of small tensors, see ``packing.py``, is one concatenation of at
most ``max_elements`` elements per member). Fills are written on the host one tensor at
a time too.

A runtime checkpoint given as ``init_from`` is read for its tensors only: its step count,
seed and hyperparameters (and its digest, which would mean reading the whole file once
more) are ``load_checkpoint``'s business (``--resume``).

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepbundle.schema.manifest import Manifest, SectionKind, StateEntry, StateKind

from .. import _compat
from ..dtypes import NUMPY_DTYPES, array_from_section
from ..errors import CheckpointError
from ..io.tensor_file import SafetensorsFile
from ..placement.packing import Layout, Pack
from .init_source import InitSource

__all__ = [
    "InitPlan",
    "InitStateError",
    "Origin",
    "place_state",
    "plan_initial_state",
]

_SHOWN = 5  # names listed in a message


class InitStateError(CheckpointError):
    """The initial state cannot be built from the bundle and the checkpoint given.

    Raised before anything is placed on a device. ``names`` lists the state (or file
    tensor) names concerned.
    """

    def __init__(self, message: str, names: tuple[str, ...]) -> None:
        super().__init__(message)
        self.names = names


class Origin(str, enum.Enum):
    """Where a state entry's initial value comes from."""

    STORED = "stored"  # the bundle's tensor section
    RULE = "rule"  # the bundle's fill section: one element, repeated
    FILE = "file"  # the checkpoint given as init_from


@dataclass(frozen=True)
class InitPlan:
    """Where every state entry's initial value comes from, checked.

    Attributes:
      origins: state name -> its origin, for every entry of the state table.
      from_file: state name -> the file and tensor name it is read from.
      unexpected: checkpoint tensors no state entry names (ignored: ``strict=False``).
    """

    origins: Mapping[str, Origin]
    from_file: Mapping[str, tuple[SafetensorsFile, str]]
    unexpected: tuple[str, ...] = ()

    def counts(self) -> dict[Origin, int]:
        out = dict.fromkeys(Origin, 0)
        for origin in self.origins.values():
            out[origin] += 1
        return out


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    more = len(names) - _SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _bundle_origin(entry: StateEntry, kinds: Mapping[str, SectionKind]) -> Origin | None:
    """What the bundle holds for ``entry``: stored, by rule, or nothing (None)."""
    kind = kinds[entry.section]
    if kind is SectionKind.EXTERNAL:
        return None
    return Origin.RULE if kind is SectionKind.FILL else Origin.STORED


def plan_initial_state(
    manifest: Manifest, source: InitSource | None, *, strict: bool = True
) -> InitPlan:
    """Decide where each state entry's initial value comes from, and check it all.

    Every entry named (by its name or an alias) in ``source`` is read from it. Without
    ``strict``, tensors of ``source`` that no entry names are ignored (``unexpected``)
    and parameters it lacks keep the bundle's value; with ``strict`` both are refused.
    An entry the bundle holds no value for (``external``) must be in ``source`` either
    way, and dtypes and shapes must always match exactly.

    Raises (before anything is read or placed):
      InitStateError: a tensor of ``source`` does not match its entry's dtype or shape;
        an entry has no value, or (strict) a parameter is not in ``source``; (strict)
        ``source`` holds tensors no entry names. ``names`` lists them.
    """
    kinds = {s.name: s.kind for s in manifest.sections}
    where = "" if source is None else f" {str(source.path)!r}"
    tensors = {} if source is None else source.tensors
    origins: dict[str, Origin] = {}
    from_file: dict[str, tuple[SafetensorsFile, str]] = {}
    used: set[str] = set()
    wrong_dtype: list[str] = []  # one line of the message per tensor
    wrong_shape: list[str] = []
    dtype_names: list[str] = []  # the file's names of those tensors
    shape_names: list[str] = []
    missing: list[str] = []
    for entry in manifest.state:
        present = [n for n in (entry.name, *entry.aliases) if n in tensors]
        used.update(present)
        for name in present:
            record = tensors[name][1]
            shown = name if name == entry.name else f"{name} (an alias of {entry.name!r})"
            if record.dtype is not entry.spec.dtype:
                wrong_dtype.append(f"{shown}: the file has {record.spec}, the bundle {entry.spec}")
                dtype_names.append(name)
            elif record.shape != entry.spec.shape:
                wrong_shape.append(f"{shown}: the file has {record.spec}, the bundle {entry.spec}")
                shape_names.append(name)
        own = _bundle_origin(entry, kinds)
        if present:
            origins[entry.name] = Origin.FILE
            from_file[entry.name] = (tensors[present[0]][0], present[0])
        elif own is None or (strict and source is not None and entry.kind is StateKind.PARAMETER):
            missing.append(entry.name)
        else:
            origins[entry.name] = own
    unexpected = sorted(set(tensors) - used)
    external = {e.name for e in manifest.state if _bundle_origin(e, kinds) is None}
    if wrong_dtype:
        raise InitStateError(
            f"The checkpoint{where} holds {len(wrong_dtype)} tensor(s) of another dtype "
            f"than the bundle's state: {'; '.join(wrong_dtype[:_SHOWN])}. Nothing was "
            "loaded. Cast them when saving (model.to(dtype) before save_pretrained), or "
            "export the bundle from a model of the checkpoint's dtype.",
            tuple(dtype_names),
        )
    if wrong_shape:
        raise InitStateError(
            f"The checkpoint{where} holds {len(wrong_shape)} tensor(s) of another shape "
            f"than the bundle's state: {'; '.join(wrong_shape[:_SHOWN])}. Nothing was "
            "loaded. The checkpoint is of another model configuration: export the bundle "
            "from the model the checkpoint was saved from.",
            tuple(shape_names),
        )
    if missing:
        if source is None:
            message = (
                f"The bundle holds no value for {len(missing)} state tensor(s) "
                f"({_listed(missing)}): it was exported without state. Give the checkpoint "
                "to start from: load(path, LoadOptions(state=StateOptions(init_from=CHECKPOINT))) or stepbundle run "
                "--init-from CHECKPOINT (a .safetensors file, a model.safetensors.index.json "
                "or a save_pretrained folder)."
            )
        else:
            hint = (
                f" It holds tensors no state entry names, such as {_listed(unexpected)}: "
                "the names may differ by a prefix (a model wrapped in another module)."
                if unexpected
                else ""
            )
            relax = (
                " Without strict (--no-init-strict), parameters the checkpoint lacks keep "
                "the bundle's values."
                if all(n not in external for n in missing)
                else ""
            )
            message = (
                f"The checkpoint{where} lacks {len(missing)} state tensor(s) the bundle "
                f"needs ({_listed(missing)}), under their names or aliases.{hint} Nothing "
                f"was loaded. Give a checkpoint of this model.{relax}"
            )
        raise InitStateError(message, tuple(missing))
    if unexpected and strict:
        raise InitStateError(
            f"The checkpoint{where} holds {len(unexpected)} tensor(s) the bundle's state "
            f"table does not name: {_listed(unexpected)}. Nothing was loaded. Give a "
            "checkpoint of this model, or pass strict=False (--no-init-strict) to ignore "
            "them.",
            tuple(unexpected),
        )
    return InitPlan(origins, from_file, tuple(unexpected))


def _fill(entry: StateEntry, data: memoryview) -> np.ndarray[Any, Any]:
    """The value of a fill: its one element at every position (bit for bit)."""
    dt = NUMPY_DTYPES[entry.spec.dtype]
    element = np.frombuffer(data, dtype=np.uint8 if dt == np.bool_ else dt, count=1)
    if dt == np.bool_ and element[0] > 1:
        raise CheckpointError(
            f"The fill section of state {entry.name!r} holds the byte {int(element[0])}, "
            "which is not a bool (0 or 1); the bundle is malformed. Export it again."
        )
    if not any(bytes(data)):
        # Zeros (every fresh optimizer's fill) come from calloc: a large one is a fresh
        # mapping whose pages are never written, so copying it to the device costs no
        # resident memory.
        return np.zeros(entry.spec.shape, dtype=dt)
    out = np.empty(entry.spec.shape, dtype=dt)
    out[...] = element.view(dt)[0]
    return out


def place_state(
    manifest: Manifest,
    layout: Layout,
    plan: InitPlan,
    section: Callable[[str], memoryview],
    put: Callable[[str, np.ndarray[Any, Any]], Any],
) -> list[Any]:
    """The trainer's device buffers, built and placed one at a time.

    ``section`` gives a bundle section's bytes (digest-checked), ``put`` places a host
    array as a layout buffer. Each buffer is waited for before its file pages are
    released and the next one is read, which bounds the host memory loading takes.
    """
    entries = {s.name: s for s in manifest.state}

    def host(name: str) -> np.ndarray[Any, Any]:
        entry = entries[name]
        origin = plan.origins[name]
        if origin is Origin.FILE:
            f, key = plan.from_file[name]
            return f.array(key)
        if origin is Origin.RULE:
            return _fill(entry, section(entry.section))
        return array_from_section(section(entry.section), entry.spec)

    def release(name: str) -> None:
        if plan.origins[name] is Origin.FILE:
            f, key = plan.from_file[name]
            f.release(key)

    out: list[Any] = []
    for buffer, buffer_name in zip(layout.buffers, layout.buffer_names):
        members = [m.state for m in buffer.members] if isinstance(buffer, Pack) else [buffer]
        if isinstance(buffer, Pack):
            value = np.concatenate([host(m).reshape(-1) for m in members])
        else:
            value = host(buffer)
        placed = put(buffer_name, value)
        del value
        _compat.block([placed])
        for m in members:
            release(m)
        out.append(placed)
    return out
