"""The exporter's one door to torch_xla: every private call, counter name and RNG call.

The tracer reads torch_xla internals that have no public API: tensor ids, the inputs of
a pending graph, whether a tensor was updated in place, metric counters, the RNG seed
graph input. torch_xla changes its private ``_XLAC`` functions between releases without
notice, so every use of them lives here, behind typed functions that check the shape of
what comes back and raise ``ExportError`` (never a wrong answer) when it is not what
the tested release returns. Upgrading torch_xla means reading this file and running
``tests/exporter/test_xla_api.py``, which calls each function against real torch_xla.

The rest of the exporter imports torch_xla only through this module.

Imports: torch, torch_xla, stepbundle.frontend.errors (frontend_core/errors.py),
stepbundle.schema.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stepbundle.frontend.errors import ExportError
from stepbundle.schema.version import MATMUL_PRECISIONS

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "TESTED_TORCH_XLA",
    "RoundTrips",
    "TensorValue",
    "check_version",
    "counters",
    "checkpoint_function",
    "device",
    "get_rng_state",
    "graph_inputs",
    "ir_debug",
    "ir_debugging",
    "ir_text",
    "is_spmd",
    "lower",
    "mark_composite",
    "numbers_as_constants",
    "package_dir",
    "round_trips",
    "seed_input_id",
    "set_rng_state",
    "skip_step",
    "sync",
    "syncfree_family",
    "tensor_id",
    "tensor_values",
    "torch_xla_version",
]

# The torch_xla release (major, minor) whose private API this module is written and
# tested against; any patch release of it is accepted.
# 2026-12: (2, 9), with torch 2.9. The debug-string parse of in-place updates was
#   replaced by _check_tensor_need_materialization and _unique_id_for_ir_and_data.
TESTED_TORCH_XLA: tuple[int, int] = (2, 9)

ALLOW_UNTESTED_ENV = "STEPBUNDLE_ALLOW_UNTESTED_TORCH_XLA"
"""Set to 1 to export with an untested torch_xla release anyway (the opt-out of the check)."""

# torch_xla's metric counters the tracer reads to find a step that left the graph.
# Each CPU fallback op ticks a counter named "aten::<op>"; reading a device value on the
# host ticks aten::_local_scalar_dense, and running a graph ticks ExecuteComputation.
_FALLBACK_PREFIX = "aten::"
_HOST_READ_COUNTER = "aten::_local_scalar_dense"
_EXECUTE_COUNTER = "ExecuteComputation"

_version_checked = False


def _module(name: str) -> Any:
    """A torch_xla module, untyped: torch_xla ships no type information for these."""
    return importlib.import_module(name)


def package_dir() -> str:
    """The folder torch_xla is installed in (host-read refusals skip its frames)."""
    return os.path.dirname(str(_module("torch_xla").__file__))


def torch_xla_version() -> str:
    """The installed torch_xla's version string (``torch_xla.__version__``)."""
    return str(_module("torch_xla").__version__)


def check_version(version: str | None = None) -> None:
    """Refuse a torch_xla release outside the tested one (``TESTED_TORCH_XLA``).

    ``version`` defaults to the installed one; setting ``STEPBUNDLE_ALLOW_UNTESTED_TORCH_XLA=1``
    skips the check.

    Raises:
      ExportError: the version is not the tested release, or cannot be read.
    """
    found = torch_xla_version() if version is None else version
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    m = re.match(r"(\d+)\.(\d+)(?:\.|$|\+|rc|a|b|dev)", found)
    if m is not None and (int(m.group(1)), int(m.group(2))) == TESTED_TORCH_XLA:
        return
    major, minor = TESTED_TORCH_XLA
    raise ExportError(
        f"This stepbundle exporter is tested with torch_xla {major}.{minor}.x, and torch_xla "
        f"{found} is installed. The exporter reads torch_xla's private API to bind every "
        "graph input, and that API changes between releases, so another release could "
        f"write a wrong bundle. Install the tested release (pip install "
        f"'torch_xla~={major}.{minor}.0' 'torch~={major}.{minor}.0'), or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try this one at your own risk."
    )


def _xlac() -> Any:
    """torch_xla's private C++ bindings, after the version check (done once)."""
    global _version_checked
    if not _version_checked:
        check_version()
        _version_checked = True
    return _module("torch_xla")._XLAC


def _api_changed(function: str, got: object, expected: str) -> ExportError:
    major, minor = TESTED_TORCH_XLA
    return ExportError(
        f"torch_xla's private function {function} returned {got!r} ({type(got).__name__}), "
        f"not {expected} as in torch_xla {major}.{minor}: torch_xla {torch_xla_version()} "
        "changed its API, and the exporter cannot tell which tensors the step reads and "
        f"writes. Install torch_xla {major}.{minor}.x, or update stepbundle/exporter/xla.py "
        "for this release."
    )


def device() -> torch.device:
    """The default XLA device (created on first use, before any autograd runs)."""
    device: torch.device = _module("torch_xla").device()
    return device


def sync() -> None:
    """Materialize every pending lazy tensor (torch_xla's mark_step) and wait for it.

    Waiting matters: torch_xla executes asynchronously, and an execution still running
    would later tick the counters the tracer reads to detect mid-step round trips.
    """
    _module("torch_xla").sync()
    _module("torch_xla.core.xla_model").wait_device_ops()


def get_rng_state() -> int:
    """torch_xla's current device RNG seed (every sync advances it)."""
    return int(_module("torch_xla.core.xla_model").get_rng_state())


def matmul_precision() -> str:
    """The matmul/convolution precision torch_xla lowers float32 ops at
    (``_XLAC._xla_get_mat_mul_precision``, what ``torch_xla.backends`` reads)."""
    got = _xlac()._xla_get_mat_mul_precision()
    if got not in MATMUL_PRECISIONS:
        raise _api_changed("_XLAC._xla_get_mat_mul_precision", got, "default, high or highest")
    return str(got)


def set_rng_state(seed: int) -> None:
    """Set torch_xla's device RNG seed."""
    _module("torch_xla.core.xla_model").set_rng_state(seed)


def is_spmd() -> bool:
    """Whether torch_xla is in SPMD mode (``xr.use_spmd()`` was called)."""
    return bool(_module("torch_xla.runtime").is_spmd())


def syncfree_family(opt: torch.optim.Optimizer) -> str | None:
    """``"syncfree_adam"`` or ``"syncfree_sgd"`` for torch_xla's syncfree optimizers, else None."""
    syncfree = _module("torch_xla.amp.syncfree")

    if isinstance(opt, (syncfree.Adam, syncfree.AdamW)):
        return "syncfree_adam"
    if isinstance(opt, syncfree.SGD):
        return "syncfree_sgd"
    return None


def checkpoint_function() -> Any:
    """torch_xla's ``CheckpointFunction`` (``torch_xla.utils.checkpoint``), which
    ``exporter/segments.py`` watches while a step is traced."""
    return _module("torch_xla.utils.checkpoint").CheckpointFunction


def mark_composite(
    tensors: Sequence[torch.Tensor],
    name: str,
    instance: str,
    is_input: bool,
    attributes: Mapping[str, bool | int | float | str] | None = None,
) -> list[torch.Tensor]:
    """``tensors`` marked as the inputs (or outputs, which carry ``attributes``) of one
    ``stablehlo.composite`` named ``name`` (torch_xla's ``StableHLOCompositeBuilder``,
    whose random instance id would make two traces of one step differ: ``instance`` is
    the caller's, stable across traces). torch_xla's lowering turns the ops between the
    marks into the composite's decomposition; a marked tensor the graph never reaches is
    not an operand or result."""
    _module("torch_xla.experimental.xla_marker")  # defines torch.ops.xla.mark_tensor
    attr = None if is_input or attributes is None else tuple(attributes.items())
    mark = torch.ops.xla.mark_tensor
    return [
        mark(t, name=name, pos=i, id=instance, is_input=is_input, attr=attr)
        for i, t in enumerate(tensors)
    ]


@contextlib.contextmanager
def numbers_as_constants() -> Iterator[None]:
    """Within it, Python numbers in lazy ops become constants of the graph, not graph
    inputs (torch_xla's ``all_numbers_special_scalars``; by default only 0 and 1 are):
    a composite's decomposition must not read @main's arguments other than its
    operands. Restores the setting on exit."""
    xlac = _xlac()
    before = xlac._get_xla_all_numbers_special_scalars()
    if not isinstance(before, bool):
        raise _api_changed("_XLAC._get_xla_all_numbers_special_scalars", before, "a bool")
    xlac._set_xla_all_numbers_special_scalars(True)
    try:
        yield
    finally:
        xlac._set_xla_all_numbers_special_scalars(before)


def lower(roots: Sequence[torch.Tensor]) -> tuple[str, bytes]:
    """The pending graph that computes ``roots``: StableHLO text and portable artifact.

    The text's module name carries a process-wide counter that is not part of the graph;
    it is replaced by ``@main_module`` so that two traces of one step compare equal.
    """
    xm = _module("torch_xla.core.xla_model")
    text = xm.get_stablehlo(list(roots))
    data = xm.get_stablehlo_bytecode(list(roots))
    if not isinstance(text, str) or not text.lstrip().startswith("module"):
        shown = text[:60] if isinstance(text, str) else text
        raise _api_changed("xla_model.get_stablehlo", shown, "StableHLO module text")
    if not isinstance(data, bytes):
        raise _api_changed("xla_model.get_stablehlo_bytecode", type(data), "bytes")
    return re.sub(r"^module @[\w.]+", "module @main_module", text, count=1), data


def skip_step(state: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Drop the pending (traced, lowered) graph instead of running it, if that is safe.

    Every tensor in ``state`` gets a placeholder of its dtype and shape: device data
    with a new tensor id and no buffer, so the next traced step reads it as a graph
    input, as after a real step, without compiling and running this one. Reading a
    placeholder's value fails; the exporter reads the initial state before tracing.

    torch_xla drops the pending value of *every* live tensor on the device, so a tensor
    outside ``state`` the user's step wrote would be left without a value (reading it
    aborts the process). Such tensors are returned and nothing is dropped: the caller
    runs the step (``sync()``). An empty list means the step was dropped.

    The placeholder is swapped in with ``t.data = ...``, not ``_XLAC._replace_xla_tensor``:
    after the latter, views made from a parameter (``weight.t()`` in ``F.linear``) still
    named the old tensor in the next graph, whose pending value had been dropped.
    """
    xlac = _xlac()
    pending = _pending_outside(state)
    if pending:
        return pending
    builder = _module("torch_xla.core.xla_builder")
    xlac._clear_pending_irs(str(device()))
    for t in state:
        placeholder = builder.create_placeholder_tensor(tuple(int(d) for d in t.shape), t.dtype)
        t.data = placeholder
    return []


def _pending_outside(state: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors Python code can still reach, other than ``state``, whose value is pending.

    Found through the garbage collector: every live XLA tensor that some Python object
    refers to (a closure cell, a module's globals, an object's attributes). Tensors only
    torch's C++ side keeps alive (views backward made of a parameter) are left out: no
    Python code can read them. ``_XLAC._get_tensors_handle`` raises for a tensor that
    has no device data yet (device data and placeholders have a handle). A Python object
    that holds a state tensor's torch_xla tensor (same id, as the optimizer's own lists
    do) is that state tensor, and so is the base it is a view of.
    """
    xlac = _xlac()
    keep: set[int] = set()
    for t in state:
        base: torch.Tensor | None = t
        while base is not None:
            keep.add(tensor_id(base))
            base = base._base
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on deprecated module attributes
        candidates = [
            o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "xla"
        ]
    waiting = []
    for t in candidates:
        try:
            tid = xlac._xla_get_tensor_id(t)
        except RuntimeError:
            continue  # on the xla device but not torch_xla's (a dynamo fake tensor)
        if tid in keep:
            continue
        try:
            xlac._get_tensors_handle([t])
        except RuntimeError:
            waiting.append(t)
    del candidates
    if not waiting:
        return []
    # Which of them a Python object refers to: one pass over the referrers of them all.
    ids = {id(t): t for t in waiting}
    ours = {id(waiting), id(ids), id(sys._getframe())}
    reachable: dict[int, torch.Tensor] = {}
    for r in gc.get_referrers(*waiting):
        if id(r) in ours:
            continue
        for x in gc.get_referents(r):
            if id(x) in ids:
                reachable[id(x)] = ids[id(x)]
    return list(reachable.values())


def tensor_id(t: torch.Tensor) -> int:
    """torch_xla's id of an XLA tensor (``_XLAC._xla_get_tensor_id``); graph inputs name it."""
    got = _xlac()._xla_get_tensor_id(t)
    if not isinstance(got, int):
        raise _api_changed("_XLAC._xla_get_tensor_id", got, "an int")
    return got


def seed_input_id() -> int:
    """The id ``graph_inputs`` gives the RNG seed input (``_XLAC._get_seed_info_id``)."""
    got = _xlac()._get_seed_info_id()
    if not isinstance(got, int):
        raise _api_changed("_XLAC._get_seed_info_id", got, "an int")
    return got


def graph_inputs(roots: Sequence[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """The inputs of the pending graph that computes ``roots``, in parameter order.

    Returns each input's torch_xla tensor id (``seed_input_id()`` for the RNG seed) and
    its current value (``_XLAC._get_tensors_xla_device_data_node``).
    """
    got = _xlac()._get_tensors_xla_device_data_node(list(roots))
    ok = isinstance(got, tuple) and len(got) == 2
    ids, values = (list(got[0]), list(got[1])) if ok else ([], [])
    if (
        not ok
        or len(ids) != len(values)
        or not all(isinstance(i, int) for i in ids)
        or not all(isinstance(v, torch.Tensor) for v in values)
    ):
        raise _api_changed(
            "_XLAC._get_tensors_xla_device_data_node", got, "(list of ids, list of tensors)"
        )
    return ids, values


@dataclass(frozen=True)
class TensorValue:
    """What an XLA tensor holds at one moment, to tell whether a step wrote to it.

    A tensor id does not tell: in-place updates such as BatchNorm's running statistics
    keep the id and only replace the graph node behind it. Two ``TensorValue`` of the
    same tensor are equal exactly when it holds the same device buffer, or the same
    pending graph node. (A graph that merely reads a tensor gives it a device-data node
    for the same buffer: that is no change.)

    Attributes:
      pending: a computation must run to produce the value (torch_xla's
        ``_check_tensor_need_materialization``); false for a tensor holding device data.
      identity: for a pending tensor, its graph node (``_unique_id_for_ir_and_data``,
        which torch_xla's dynamo bridge dedups inputs by); otherwise its device buffer's
        handle (``_get_tensors_handle``).
    """

    pending: bool
    identity: str


def tensor_values(tensors: Sequence[torch.Tensor]) -> list[TensorValue]:
    """The ``TensorValue`` of each XLA tensor, in order."""
    xlac = _xlac()
    tensors = list(tensors)
    pending = xlac._check_tensor_need_materialization(tensors)
    if (
        not isinstance(pending, list)
        or len(pending) != len(tensors)
        or not all(isinstance(p, bool) for p in pending)
    ):
        raise _api_changed(
            "_XLAC._check_tensor_need_materialization", pending, "one bool per tensor"
        )
    held = [t for t, p in zip(tensors, pending) if not p]
    handles = xlac._get_tensors_handle(held) if held else []
    if (
        not isinstance(handles, list)
        or len(handles) != len(held)
        or not all(isinstance(h, int) for h in handles)
    ):
        raise _api_changed("_XLAC._get_tensors_handle", handles, "one int per tensor")
    buffers = iter(handles)
    out = []
    for t, p in zip(tensors, pending):
        if not p:
            out.append(TensorValue(False, f"buffer {next(buffers)}"))
            continue
        node = xlac._unique_id_for_ir_and_data(t)
        if not isinstance(node, str) or not node:
            raise _api_changed("_XLAC._unique_id_for_ir_and_data", node, "a non-empty str")
        out.append(TensorValue(True, f"node {node}"))
    return out


def counters() -> dict[str, int]:
    """A snapshot of every torch_xla metric counter."""
    met = _module("torch_xla.debug.metrics")
    return {n: int(met.counter_value(n) or 0) for n in met.counter_names()}


def ops_traced() -> int:
    """How many operator calls torch_xla has traced in this process (its ``xla::<op>``
    counters, one per call it lowered): a progress count while a step is traced."""
    met = _module("torch_xla.debug.metrics")
    return sum(int(met.counter_value(n) or 0) for n in met.counter_names() if n.startswith("xla::"))


@dataclass(frozen=True)
class RoundTrips:
    """How a step left the graph between two ``counters()`` snapshots.

    Attributes:
      cpu_ops: aten ops torch_xla ran on the CPU (it has no XLA lowering for them).
      host_reads: a device value was read on the host, or a graph was executed, in the
        middle of the step.
    """

    cpu_ops: tuple[str, ...]
    host_reads: bool


def round_trips(before: Mapping[str, int], after: Mapping[str, int]) -> RoundTrips:
    """What ticked between two ``counters()`` snapshots taken around a step."""
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    ops = tuple(
        k.removeprefix(_FALLBACK_PREFIX)
        for k in sorted(grew)
        if k.startswith(_FALLBACK_PREFIX) and k != _HOST_READ_COUNTER
    )
    return RoundTrips(ops, bool(grew.get(_HOST_READ_COUNTER, 0) or grew.get(_EXECUTE_COUNTER, 0)))


@contextlib.contextmanager
def ir_debug() -> Iterator[None]:
    """Within it, torch_xla records each IR node's Python source location (its
    ``XLA_IR_DEBUG`` metadata, ``_XLAC._set_ir_debug``), which ``ir_text`` shows.

    Only for explaining a refusal: recording frames slows tracing markedly and the
    metadata reaches the lowered program.
    """
    xlac = _xlac()
    before = bool(xlac._get_ir_debug())
    xlac._set_ir_debug(True)
    try:
        yield
    finally:
        xlac._set_ir_debug(before)


def ir_debugging() -> bool:
    """Whether torch_xla records source locations now (inside ``ir_debug``)."""
    return bool(_xlac()._get_ir_debug())


def ir_text(roots: Sequence[torch.Tensor]) -> str:
    """torch_xla's IR of the pending graph that computes ``roots``, one node a line
    (``_XLAC._get_xla_tensors_text``), with ``location=`` where it was recorded."""
    got = _xlac()._get_xla_tensors_text(list(roots))
    if not isinstance(got, str):
        raise _api_changed("_XLAC._get_xla_tensors_text", type(got), "str")
    return got
