"""The training state on the device: the trainer's part that owns the state buffers.

``StateStore`` holds one device buffer per entry of the layout (a state tensor on its
own, or a pack of small ones, see ``packing.py``) and whether they can still be used: a
step that failed inside the device after donating its state, or a trainer loaded with
``compile_only``, leaves it ``broken`` with the sentence that says why, until a state
is put back. It reads the state out under PyTorch's names and replaces it from named
arrays (``state.py`` converts between the two forms).

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from stepbundle.schema.manifest import Manifest

from .. import _compat
from ..compile.state_masks import MaskPins
from ..errors import BindingError
from ..placement.packing import Layout, Pack
from ..placement.sharding import Placement
from ..state.named import StreamedState, check_state_values, host_buffers, named_values

__all__ = ["StateStore"]


class StateStore:
    """The device buffers of the training state, and whether they may be used.

    Attributes:
      layout: how the state is held (which tensors share a pack).
      placement: where the buffers live.
      buffers: the device buffers, one per ``layout.buffer_names`` entry; a step
        replaces the ones it updates in place in this list.
      names: the state names, in the state table's order (PyTorch's names).
      broken: why the state cannot be used (its buffers were donated to a failed step,
        or none were placed), or None.
      pins: the mask buffers fused programs assume keep their loaded value; new state
        that changes one is refused (``compile/state_masks.py``).
    """

    def __init__(
        self, manifest: Manifest, layout: Layout, placement: Placement, buffers: list[Any]
    ) -> None:
        self.layout = layout
        self.placement = placement
        self.buffers = buffers
        self.names = tuple(e.name for e in manifest.state)
        self.broken: str | None = None
        self._manifest = manifest
        self._aliases = {e.name: e.aliases for e in manifest.state}
        self.pins = MaskPins({})

    def check_usable(self) -> None:
        """Raise ``BindingError`` with the reason when the state cannot be used."""
        if self.broken is not None:
            raise BindingError(self.broken)

    def state_dict(
        self, *, include_aliases: bool = True, copy: bool = True
    ) -> dict[str, np.ndarray[Any, Any]]:
        """The current state as numpy arrays (copies), under PyTorch's names; tied
        weights under each of their names with ``include_aliases``. ``copy=False``: views
        of the buffers that lie in this process's memory (CPU devices), to be read before
        the next step (``Trainer.state_dict``)."""
        self.check_usable()
        # One transfer per buffer, each when its turn comes.
        # Uncached: jax would otherwise keep a host copy of every buffer until the next
        # step replaces it, the whole state twice on the host with the copies returned.
        host = _compat.to_host_uncached if copy else _compat.to_host_view
        values = named_values(self.layout, (host(b) for b in self.buffers))
        out: dict[str, np.ndarray[Any, Any]] = {}
        for name in self.names:
            out[name] = values[name]
            if include_aliases:
                for alias in self._aliases.get(name, ()):
                    out[alias] = values[name]
        return out

    def streamed(self) -> StreamedState:
        """The state under every name (aliases too), each tensor copied from the device
        only when it is read (``StreamedState``)."""
        self.check_usable()
        return StreamedState(
            self._manifest,
            self.layout,
            list(self.buffers),
            _compat.to_host_uncached,
            _compat.gathers_across_processes,
        )

    def load(self, values: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """Replace the state with ``values`` (every state name, exact dtypes and shapes)."""
        self.put(check_state_values(self._manifest, values))

    def put(
        self,
        arrays: Mapping[str, np.ndarray[Any, Any]],
        after: Callable[[str], None] | None = None,
    ) -> None:
        """Replace the state with ``arrays``, already checked against the state table.

        ``after(state_name)`` is called for each state tensor once its buffer is on the
        devices (a mapped checkpoint file drops that tensor's pages).

        Raises:
          FusedMaskError: ``arrays`` changes a mask buffer a fused program assumes.
        """
        self.pins.check(arrays)
        buffers = []
        for entry, name, a in zip(
            self.layout.buffers, self.layout.buffer_names, host_buffers(self.layout, arrays)
        ):
            buffers.append(self.placement.put_state(name, a))
            del a
            if after is not None:
                names = [m.state for m in entry.members] if isinstance(entry, Pack) else [entry]
                for state_name in names:
                    after(state_name)
        self.buffers = buffers
        self.broken = None

    def block_until_ready(self) -> None:
        """Wait until every dispatched step has finished."""
        _compat.block(self.buffers)

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes of the state resident on each of this process's devices."""
        return self.placement.bytes_per_device(self.buffers)
