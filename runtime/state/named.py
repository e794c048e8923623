"""Training state between its two forms: PyTorch's named tensors and the layout's buffers.

The trainer holds one device buffer per entry of the layout (a state tensor on its
own, or a pack of small ones, see ``packing.py``); users, checkpoints and PyTorch see
one array per state name. ``check_state_values`` checks named arrays against the
bundle's state table, ``host_buffers`` joins them into the layout's buffers and
``named_values`` splits host copies of the buffers back into named arrays.

Imports: numpy, stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from stepbundle.schema.manifest import Manifest

from ..dtypes import NUMPY_DTYPES
from ..errors import CheckpointError
from ..placement.packing import Layout, Pack

__all__ = [
    "OrderedReads",
    "StreamedState",
    "check_state_values",
    "host_buffers",
    "named_values",
]


def check_state_values(
    manifest: Manifest, values: Mapping[str, np.ndarray[Any, Any]]
) -> dict[str, np.ndarray[Any, Any]]:
    """Map ``values`` (which may use alias names) onto the state table, checking specs.

    Raises:
      CheckpointError: a state name is missing, a dtype or shape differs from the state
        table, or a name is unknown.
    """
    out: dict[str, np.ndarray[Any, Any]] = {}
    problems = []
    for s in manifest.state:
        names = (s.name, *s.aliases)
        found = next((values[n] for n in names if n in values), None)
        if found is None:
            problems.append(f"missing {s.name!r}")
            continue
        a = np.asarray(found)
        want = NUMPY_DTYPES[s.spec.dtype]
        if a.dtype != want or tuple(a.shape) != s.spec.shape:
            problems.append(f"{s.name!r} is {a.dtype}{list(a.shape)}, the bundle has {s.spec}")
            continue
        out[s.name] = a
    known = {n for s in manifest.state for n in (s.name, *s.aliases)}
    extra = sorted(set(values) - known)
    if extra:
        problems.append(f"unknown name(s) {', '.join(map(repr, extra[:5]))}")
    if problems:
        raise CheckpointError(
            "The state does not match this bundle's state table: "
            + "; ".join(problems[:8])
            + ". Load a checkpoint written for this bundle (same model and optimizer)."
        )
    return out


def host_buffers(
    layout: Layout, arrays: Mapping[str, np.ndarray[Any, Any]]
) -> Iterator[np.ndarray[Any, Any]]:
    """The host arrays of the layout's buffers, one at a time: packs concatenated (a
    pack's copy is made when its turn comes), others as they are (views stay views)."""
    for entry in layout.buffers:
        if isinstance(entry, Pack):
            yield np.concatenate([np.asarray(arrays[m.state]).reshape(-1) for m in entry.members])
        else:
            yield np.asarray(arrays[entry])


def named_values(
    layout: Layout, hosts: Iterable[np.ndarray[Any, Any]]
) -> dict[str, np.ndarray[Any, Any]]:
    """Split host copies of the layout's buffers into one array per state name (copies).

    ``hosts`` may be a generator: each buffer is then copied to the host only when its
    turn comes, and a pack's host copy is dropped once its members are sliced out.
    """
    values: dict[str, np.ndarray[Any, Any]] = {}
    for entry, host in zip(layout.buffers, hosts):
        if isinstance(entry, Pack):
            for m in entry.members:
                values[m.state] = host[m.offset : m.offset + m.numel].reshape(m.shape).copy()
        else:
            values[entry] = host
    return values


class StreamedState(Mapping[str, np.ndarray[Any, Any]]):
    """The state under PyTorch's names, each tensor copied from the device when it is
    read and not kept: a checkpoint written from it holds one tensor on the host at a
    time (plus the packs of small tensors, each copied once and kept while this object
    lives), however much state the devices hold together.

    ``to_host(buffer)`` is the copy (a gather for a buffer split over several processes'
    devices, ``gathers(buffer)``: a collective, so in a multi-process job every process
    reads through ``OrderedReads``). ``specs`` gives each name's dtype and shape without
    copying anything.
    """

    def __init__(
        self,
        manifest: Manifest,
        layout: Layout,
        buffers: list[Any],
        to_host: Callable[[Any], np.ndarray[Any, Any]],
        gathers: Callable[[Any], bool] = lambda buffer: False,
    ) -> None:
        self._to_host = to_host
        self._gathers = gathers
        self._packs: dict[str, np.ndarray[Any, Any]] = {}
        where: dict[str, tuple[Any, Pack | None, Any]] = {}
        for entry, buf in zip(layout.buffers, buffers):
            if isinstance(entry, Pack):
                for m in entry.members:
                    where[m.state] = (buf, entry, m)
            else:
                where[entry] = (buf, None, None)
        self._where: dict[str, tuple[Any, Pack | None, Any]] = {}
        self.specs: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {}
        for e in manifest.state:
            for name in (e.name, *e.aliases):
                self._where[name] = where[e.name]
                self.specs[name] = (NUMPY_DTYPES[e.spec.dtype], tuple(e.spec.shape))

    def __getitem__(self, name: str) -> np.ndarray[Any, Any]:
        buf, pack, member = self._where[name]
        if pack is None:
            return self._to_host(buf)
        host = self._packs.get(pack.name)
        if host is None:
            host = self._packs[pack.name] = self._to_host(buf)
        piece = host[member.offset : member.offset + member.numel]
        return piece.reshape(member.shape).copy()

    def touch(self, name: str) -> None:
        """The part of reading ``name`` the other processes of a job take part in, and
        nothing more: a gather of a split buffer (its copy dropped at once), or a split
        pack's first read (its copy kept, as a read keeps it). No host copy of a buffer
        this process holds whole is made."""
        buf, pack, _ = self._where[name]
        if not self._gathers(buf):
            return
        if pack is None:
            self._to_host(buf)
        elif pack.name not in self._packs:
            self._packs[pack.name] = self._to_host(buf)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class OrderedReads(Mapping[str, np.ndarray[Any, Any]]):
    """A ``StreamedState`` read in one order every process of a job agrees on.

    Reading a tensor split over several processes' devices is a collective: all of
    them must read the same tensors in the same order. In a multi-process job the
    process that writes a checkpoint reads through this object, which refuses a read
    out of ``order``; every process then calls ``finish``, which does the collective
    part of each read left in ``order`` (``StreamedState.touch``). The writer and the
    others (which only call ``finish``) so meet in every gather whether the write got
    to its end or stopped part-way, and no process holds more than one gathered tensor.
    """

    def __init__(self, state: StreamedState, order: list[str]) -> None:
        self._state = state
        self._order = order
        self._next = 0
        self.specs = state.specs

    def __getitem__(self, name: str) -> np.ndarray[Any, Any]:
        i = self._next
        if i >= len(self._order) or self._order[i] != name:
            want = repr(self._order[i]) if i < len(self._order) else "nothing more"
            raise CheckpointError(
                f"The checkpoint's writer read {name!r} where every process of the job "
                f"reads {want} (read {i + 1} of {len(self._order)}); nothing was written. "
                "This is a bug: please report it."
            )
        self._next = i + 1  # counted before the read: a read is never tried twice
        return self._state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    @property
    def reads_left(self) -> int:
        """Reads of ``order`` not made yet."""
        return len(self._order) - self._next

    def finish(self) -> None:
        """Take part in the gathers of every read left in the order."""
        while self._next < len(self._order):
            name = self._order[self._next]
            self._next += 1
            self._state.touch(name)
