"""Every jaxlib call whose spelling differs between the versions the runtime supports.

Supported: jax/jaxlib 0.7.1 (the exporter's pin) up to the newest release pip offers
(0.10.x at the time of writing). Nothing else in the runtime touches jaxlib's client
API directly, so a new jaxlib means editing this one module.

x64: torch_xla graphs carry f64 and i64 scalars (host constants, the RNG seed). jax,
with its default ``jax_enable_x64=False``, silently narrows such arrays to 32 bits on
transfer. The runtime never changes the user's global jax configuration: it enables
x64 only inside its own transfers, with jax's thread-local scoped switch.

Imports: jax, jaxlib, numpy, and .fallback (to report which path it took).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.extend.backend import get_backend
from jaxlib import xla_client

from .fallback import PathChoice, PathKind, warn_once

# What jaxlib raises for a failed compile, deserialize or execute.
JaxRuntimeError = jax.errors.JaxRuntimeError

__all__ = [
    "JAXLIB_VERSION",
    "YNN_FUSION_OPTION",
    "cpu_numerics_overrides",
    "option_overrides",
    "job_agree",
    "compile_options",
    "compile_bytecode",
    "compile_unloaded",
    "ExecutableCall",
    "deserialize_executable",
    "gathers_across_processes",
    "get_client",
    "put_sharded",
    "serialize_executable",
    "single_device_sharding",
    "to_host",
    "to_host_uncached",
    "to_host_view",
    "transfer_path",
    "x64_scope",
]

JAXLIB_VERSION: str = str(getattr(jaxlib, "__version__", "unknown"))

Client = Any
Device = Any
Executable = Any
Array = Any


def _make_x64_scope() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    # jax >= 0.8 exposes the thread-local switch as jax.enable_x64(True). jax 0.7 has
    # the same State object under jax._src.config (jax.experimental.enable_x64 wraps it
    # in a slower generator). Remove the fallbacks when the exporter's pin passes 0.7.
    scoped = getattr(jax, "enable_x64", None)
    if scoped is None:
        try:
            from jax._src import config as _config

            scoped = _config.enable_x64
        except (ImportError, AttributeError):
            scoped = None
    if scoped is not None:
        return lambda: scoped(True)
    from jax.experimental import enable_x64

    return lambda: enable_x64(True)


x64_scope: Callable[[], contextlib.AbstractContextManager[Any]] = _make_x64_scope()


def backends_started() -> bool:
    """Whether jax has started its backends (the TPU runtime among them) in this process."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a jax without it: assume not
        return False


def get_client(platform: str) -> Client:
    """The PJRT client for ``platform`` ("cpu", "cuda", "rocm", "tpu")."""
    return get_backend(platform)


def _slow_put(x: np.ndarray[Any, Any], sharding: Any) -> Array:
    x = np.array(x, copy=True, order="C")
    with x64_scope():
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        # device_put onto other processes' devices also compares the value across
        # processes (a collective the other processes are not running): build it from
        # this process's pieces instead.
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _partly_replicated(sharding: Any, where: list[tuple[Device, Any]]) -> bool:
    """Whether some piece of ``sharding`` sits on several devices, but not every piece
    on every device (neither split nor replicated)."""
    if sharding.is_fully_replicated:
        return False
    seen = {repr(idx) for _, idx in where}
    return len(seen) < len(where)


_WIDE = frozenset({np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.uint64)})


_Put = Callable[[np.ndarray[Any, Any], Any], Array]


def _make_fast_put() -> tuple[_Put | None, str]:
    """A transfer that skips jax.device_put's Python dispatch (docs/runtime.md: a fifth
    of its host time).

    It calls jaxlib's batched transfer with an explicit abstract value and the shards
    this process holds, the call jax.device_put itself ends in. That entry point is
    internal to jax, so it is checked once here and the public path is used when it is
    missing or misbehaves; the second value says which and why. Remove this when jax
    offers a public transfer without dtype canonicalization.
    """
    try:
        from jax._src import core
        from jax._src.lib import _jax as ext  # type: ignore[attr-defined]
        from jax.sharding import SingleDeviceSharding
    except ImportError as e:
        return None, f"jaxlib's internal transfer API is not importable ({e})"
    sem = ext.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL
    avals: dict[tuple[tuple[int, ...], np.dtype[Any]], Any] = {}
    # (sharding, shape) -> [(device, index)] for the devices this process holds, or None
    # where the batched transfer cannot take the sharding (decided once, not per put).
    pieces: dict[tuple[Any, tuple[int, ...]], list[tuple[Device, Any]] | None] = {}
    unseen: Any = object()

    def fast_put(x: np.ndarray[Any, Any], sharding: Any) -> Array:
        x = np.asarray(x, order="C")
        key = (x.shape, x.dtype)
        aval = avals.get(key)
        if aval is None:
            aval = avals[key] = core.ShapedArray(x.shape, x.dtype)
        where = pieces.get((sharding, x.shape), unseen)
        if where is unseen:
            if len(pieces) > 4096:  # every trainer brings its own shardings
                pieces.clear()
            where = list(sharding.addressable_devices_indices_map(x.shape).items())
            if len(where) > 1 and _partly_replicated(sharding, where):
                # jaxlib's batched transfer fails ("bad_function_call") on a sharding
                # that repeats some pieces but not all (a 2-D mesh's tensor split over
                # one axis); jax.device_put handles it. Remove when the fast call
                # accepts them.
                where = None
            pieces[(sharding, x.shape)] = where
        if where is None:
            return _slow_put(x, sharding)
        if len(where) == 1 and isinstance(sharding, SingleDeviceSharding):
            xs, devs = [x], [where[0][0]]
        else:
            # np.require keeps a 0-d piece 0-d (ascontiguousarray would make it (1,)).
            xs = [np.require(x[idx], requirements="C") for _, idx in where]
            devs = [d for d, _ in where]
        if x.dtype in _WIDE:
            # Without x64 the transfer narrows 64-bit values; scope it to this call.
            with x64_scope():
                return ext.batched_device_put(aval, sharding, xs, devs, True, True, sem)
        return ext.batched_device_put(aval, sharding, xs, devs, True, True, sem)

    try:
        devs = jax.local_devices(backend="cpu")
        shardings: list[Any] = [SingleDeviceSharding(devs[0])]
        if len(devs) > 1:
            from jax.sharding import Mesh, NamedSharding
            from jax.sharding import PartitionSpec as _Spec

            spec: Any = _Spec
            shardings.append(NamedSharding(Mesh(np.array(devs[:2]), ("a",)), spec("a")))
        probes = [np.array(2**40 + 3, np.int64), np.array(1 / 3), np.arange(6, dtype=np.float32)]
        for sharding in shardings:
            for probe in probes:
                target = sharding
                if probe.ndim == 0 and sharding is not shardings[0]:
                    # A scalar cannot be split: it is replicated.
                    target = NamedSharding(sharding.mesh, spec())
                got_array = fast_put(probe, target)
                got = np.asarray(got_array)
                shards = {tuple(s.data.shape) for s in got_array.addressable_shards}
                if (
                    got.dtype != probe.dtype
                    or got.shape != probe.shape
                    or not np.array_equal(got, probe)
                    or (probe.ndim == 0 and shards != {()})
                ):
                    return None, (
                        f"jaxlib's internal transfer returned {got.dtype}{list(got.shape)} "
                        f"for the probe {probe.dtype}{list(probe.shape)} on {target}"
                    )
    # The signature or behaviour of the internal API changed: a missing attribute, other
    # arguments, or jaxlib refusing the call (JaxRuntimeError is a RuntimeError).
    except (AttributeError, TypeError, ValueError, RuntimeError) as e:
        return None, f"jaxlib's internal transfer failed its probe ({type(e).__name__}: {e})"
    return fast_put, "jaxlib's batched transfer (probed: exact dtypes, shapes and shards)"


# Built on first use: probing needs jax's CPU backend, and starting it at import would
# fix the number of CPU devices before a caller could ask for more.
_FAST_PUT: list[_Put | None] = []
_TRANSFER: list[PathChoice] = []
_SINGLE: dict[Device, Any] = {}


def single_device_sharding(device: Device) -> Any:
    sharding = _SINGLE.get(device)
    if sharding is None:
        from jax.sharding import SingleDeviceSharding

        sharding = _SINGLE[device] = SingleDeviceSharding(device)
    return sharding


def from_process_local(sharding: Any, x: np.ndarray[Any, Any], shape: tuple[int, ...]) -> Array:
    """A global array of ``shape`` from this process's rows ``x`` (and the other
    processes' rows, which they pass in the same call)."""
    make: Any = jax.make_array_from_process_local_data
    return make(sharding, x, shape)


def put_sharded(x: np.ndarray[Any, Any], sharding: Any) -> Array:
    """Copy a host array into ``sharding`` (one device or several), exact dtype (no x64
    narrowing).

    Always copies: a zero-copy buffer could alias memory the caller reuses, or a
    read-only mapping of the bundle that a donated buffer would then be written into.

    ``x`` is the global value; in a multi-process job each process copies only the
    pieces that belong to its own devices.
    """
    if not _FAST_PUT:
        _choose_transfer()
    fast = _FAST_PUT[0]
    if fast is not None:
        return fast(x, sharding)
    return _slow_put(x, sharding)


def _choose_transfer() -> None:
    fast, reason = _make_fast_put()
    kind = PathKind.FAST if fast is not None else PathKind.FALLBACK
    _TRANSFER.append(PathChoice("transfer", kind, reason))
    _FAST_PUT.append(fast)
    if fast is None:
        warn_once(
            "transfer",
            f"stepbundle copies arrays to the device through jax.device_put, about 5x "
            f"slower per array than its fast path: {reason}. Steps are correct but slower; "
            f"please report this with your jax version ({jax.__version__}).",
            stacklevel=4,
        )


def transfer_path() -> PathChoice:
    """How ``put_sharded`` copies arrays in this process (probed on first use)."""
    if not _FAST_PUT:
        _choose_transfer()
    return _TRANSFER[0]


def to_host(a: Array) -> np.ndarray[Any, Any]:
    """The global value of ``a`` as a new numpy array.

    Arrays spread over other processes' devices are gathered (a collective: every
    process of the job must call this for the same arrays, in the same order).
    """
    if a.is_fully_addressable:
        return np.array(a, copy=True)
    if a.is_fully_replicated:
        return np.array(a.addressable_data(0), copy=True)
    from jax.experimental import multihost_utils

    return np.array(multihost_utils.process_allgather(a, tiled=True), copy=True)


def gathers_across_processes(a: Array) -> bool:
    """Whether ``to_host(a)`` is a collective (``a`` is split over several processes'
    devices): every process of the job must then read ``a`` too, at the same point."""
    return not a.is_fully_addressable and not a.is_fully_replicated


def to_host_view(a: Array) -> np.ndarray[Any, Any]:
    """The value of ``a`` without a copy where its one piece already lies in this
    process's memory (a CPU device): a read-only view of the device buffer (jaxlib's
    conversion that reports whether it copied; the view keeps the buffer alive). Anything
    else is copied (``to_host_uncached``)."""
    if a.is_fully_addressable:
        shards = a.addressable_shards
        if len(shards) == 1 and tuple(shards[0].data.shape) == tuple(a.shape):
            fetch = getattr(shards[0].data, "_single_device_array_to_np_array_did_copy", None)
            if fetch is not None:
                view: np.ndarray[Any, Any] = fetch()[0]
                return view
    return to_host_uncached(a)


def to_host_uncached(a: Array) -> np.ndarray[Any, Any]:
    """``to_host`` that leaves no host copy behind on ``a`` (for streamed checkpoints).

    ``np.asarray`` of a jax array keeps the numpy value it made on the array
    (``_npy_value``, wherever the transfer copied: on accelerators) until the array is
    deleted; reading the whole state that way holds a host copy of all of it while the
    buffers live. Here each distinct piece of this process's shards is fetched with
    jaxlib's conversion that does not keep it (``_single_device_array_to_np_array_did_copy``,
    in jaxlib 0.7.1 and 0.10.2; ``np.asarray`` where a jaxlib lacks it) and copied into
    one new array. Arrays spread over other processes' devices go through ``to_host``.
    """
    if not a.is_fully_addressable:
        return to_host(a)
    out = np.empty(a.shape, a.dtype)
    seen: set[str] = set()
    for shard in a.addressable_shards:
        key = repr(shard.index)
        if key in seen:
            continue
        seen.add(key)
        piece: Any = shard.data
        fetch = getattr(piece, "_single_device_array_to_np_array_did_copy", None)
        # The piece may be a view of the device buffer (the CPU): copied into ``out``.
        out[shard.index] = fetch()[0] if fetch is not None else np.asarray(piece)
    return out


def job_process_id() -> int:
    """This process's rank in a multi-process job (jax.distributed's), 0 without one.

    Read from jax.distributed's state rather than ``jax.process_index()``, which would
    start the backends; the CLI asks before ``load`` chooses the device.
    """
    try:
        from jax._src import distributed as _distributed

        return int(_distributed.global_state.process_id or 0)
    except (ImportError, AttributeError):
        return 0


_AGREEMENTS = itertools.count()


def job_agree(ok: bool, timeout_s: float) -> bool | None:
    """Whether every process of a multi-process job says ``ok``; None without one.

    Goes through jax.distributed's coordination service (a key-value store), not a
    device collective: a collective's transport (gloo, NCCL) gives up on peers that
    are slow to arrive, and one process waiting in it while another failed hangs. Every
    process must call this the same number of times, in the same order. Raises
    TimeoutError when a process does not answer within ``timeout_s``.
    """
    try:
        from jax._src import distributed as _distributed

        state = _distributed.global_state
        client, n, me = state.client, state.num_processes, state.process_id
    except (ImportError, AttributeError):
        return None
    if client is None or not n or n <= 1:
        return None
    name = f"stepbundle/agree/{next(_AGREEMENTS)}"
    client.key_value_set(f"{name}/{me}", "1" if ok else "0")
    wait_ms = max(1, int(timeout_s * 1000))
    answers = []
    for i in range(n):
        try:
            answers.append(client.blocking_key_value_get(f"{name}/{i}", wait_ms))
        # jaxlib raises JaxRuntimeError (a RuntimeError) for DEADLINE_EXCEEDED or a
        # coordination service that went away; other bindings raise plain RuntimeError.
        except RuntimeError as e:
            raise TimeoutError(
                f"process {i} did not answer within {timeout_s:.0f} s ({e})"
            ) from None
    return all(a == "1" for a in answers)


YNN_FUSION_OPTION = "xla_cpu_experimental_ynn_fusion_type"
"""The XLA:CPU option naming the operations it hands to YNNPACK (reductions,
convolutions, matmuls). Newer jaxlibs hand a training program's reductions to it, and
their float32 results drift from PyTorch's: torchvision's resnet18 (64x64, SGD, four
distinct batches) on jax 0.10.2 was 1.6e-2 from PyTorch float64 at step 3, and within
1.3e-6 with the option empty (docs/numerics.md)."""

_YNN_FROM = (0, 8, 0)
"""The first jaxlib whose XLA may know ``YNN_FUSION_OPTION``. jax 0.7.1's refuses it
("No such compile option"); 0.10.2's knows it. A jaxlib in between that refuses it is
compiled without it (``compile_program``)."""


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


def cpu_numerics_overrides(xla_flags: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """The per-compile XLA options that keep CPU programs as accurate as PyTorch's, and
    what was decided, in words (``LoadInfo.cpu_numerics``).

    YNNPACK's fusions are switched off (``YNN_FUSION_OPTION`` empty) for each program
    the runtime compiles, through ``CompileOptions.env_option_overrides``: a per-compile
    option, so it holds whenever jax's CPU backend started, and touches nothing but the
    runtime's own programs. A user's ``xla_flags`` (the ``XLA_FLAGS`` environment
    variable) that mention the option win: nothing is set then.
    """
    if YNN_FUSION_OPTION in xla_flags:
        return (), f"left to XLA_FLAGS, which sets {YNN_FUSION_OPTION}"
    if _version_tuple(JAXLIB_VERSION) < _YNN_FROM:
        return (), f"nothing to set: jaxlib {JAXLIB_VERSION}'s XLA has no YNNPACK fusion"
    return ((YNN_FUSION_OPTION, ""),), f"YNNPACK fusion off ({YNN_FUSION_OPTION}= per compile)"


def compile_options(
    num_partitions: int = 1,
    device_ids: Sequence[int] | None = None,
    overrides: Sequence[tuple[str, str]] = (),
) -> Any:
    """Compile options for one replica over ``num_partitions`` devices (SPMD when > 1),
    with XLA's ``overrides`` (option name, value) for this compile only."""
    opts = xla_client.CompileOptions()
    if overrides:
        opts.env_option_overrides = list(overrides)
    build = opts.executable_build_options
    build.num_replicas = 1
    build.num_partitions = num_partitions
    if num_partitions > 1:
        build.use_spmd_partitioning = True
        # The programs carry Shardy annotations (runtime/placement/sharding.py); GSPMD's
        # propagation is deprecated in XLA.
        build.use_shardy_partitioner = True
    if device_ids is not None:
        # Without an assignment a one-device program is bound to the client's first
        # device, whatever device list it is loaded for.
        build.device_assignment = xla_client.DeviceAssignment.create(
            np.asarray(device_ids, dtype=np.int64).reshape(1, num_partitions)
        )
    return opts


def option_overrides(options: Any) -> tuple[tuple[str, str], ...]:
    """The XLA option overrides ``options`` holds (for the compile-cache key)."""
    return tuple((str(k), str(v)) for k, v in getattr(options, "env_option_overrides", ()))


def _without_unknown_ynn(options: Any, error: Exception) -> bool:
    """Drop ``YNN_FUSION_OPTION`` from ``options`` when ``error`` says this XLA does not
    know it (a jaxlib between 0.7.1 and 0.10.2 that predates YNNPACK: nothing to turn
    off); whether it did."""
    if f"No such compile option: '{YNN_FUSION_OPTION}'" not in str(error):
        return False
    kept = [(k, v) for k, v in option_overrides(options) if k != YNN_FUSION_OPTION]
    options.env_option_overrides = kept
    return True


def compile_bytecode(
    client: Client, bytecode: bytes, devices: Sequence[Device], options: Any
) -> Executable:
    """Compile MLIR bytecode for ``devices`` and load it."""
    device_list = xla_client.DeviceList(tuple(devices))
    try:
        return client.compile_and_load(bytecode, device_list, options)
    except JaxRuntimeError as e:
        if not _without_unknown_ynn(options, e):
            raise
        return client.compile_and_load(bytecode, device_list, options)


def compile_unloaded(
    client: Client, bytecode: bytes, devices: Sequence[Device], options: Any
) -> Executable:
    """Compile MLIR bytecode for ``devices`` without loading it where the client can: the
    devices may be described only (``jax.experimental.topologies``: a TPU slice this
    host is not attached to). A client that cannot compile without loading (the CPU
    client of jaxlib 0.7.1 and 0.10: "No compiler ...") compiles and loads, on devices
    it has. Either way the executable answers ``get_compiled_memory_stats`` and
    ``hlo_modules``."""
    device_list = xla_client.DeviceList(tuple(devices))
    try:
        try:
            return _compile_unloaded(client, bytecode, device_list, options)
        except JaxRuntimeError as e:
            if not _without_unknown_ynn(options, e):
                raise
            return _compile_unloaded(client, bytecode, device_list, options)
    except JaxRuntimeError as e:
        # "No compiler factory for platform: cpu" (0.10), "No compiler registered for
        # platform cpu" (0.7.1)
        if "No compiler" not in str(e):
            raise
    return compile_bytecode(client, bytecode, devices, options)


def _compile_unloaded(client: Client, bytecode: bytes, device_list: Any, options: Any) -> Any:
    try:
        return client.compile(bytecode, device_list, options)
    except TypeError:
        # jaxlib 0.10's Client.compile takes a parsed MLIR module, not bytes (0.7.1 takes
        # bytes). Remove when the oldest jaxlib supported takes modules.
        from jax._src.interpreters import mlir as jax_mlir
        from jaxlib.mlir import ir

        with jax_mlir.make_ir_context():
            return client.compile(ir.Module.parse(bytecode), device_list, options)


def serialize_executable(client: Client, exe: Executable) -> bytes:
    data = client.serialize_executable(exe)
    return bytes(data)


def deserialize_executable(
    client: Client, data: bytes, devices: Sequence[Device], options: Any
) -> Executable:
    return client.deserialize_executable(data, xla_client.DeviceList(tuple(devices)), options)


class ExecutableCall:
    """Runs one loaded executable on one device and returns its results as arrays.

    ``LoadedExecutable.execute`` builds every result array twice (once per device and
    again per result); with hundreds of results that is most of a small step's host
    time. When jaxlib offers them, this dispatches through ``execute_sharded`` and
    turns the results into arrays once, with one precomputed result handler per
    output: the path jax's own compiled calls take. It falls back to ``execute``, and
    says so in ``path`` (and with a warning, once per process). Remove the fallback when
    the oldest supported jaxlib has the handler API.
    """

    def __init__(
        self,
        executable: Executable,
        outputs: Sequence[tuple[tuple[int, ...], Any]],
        shardings: Sequence[Any],
        partitioned: bool = False,
    ) -> None:
        self.executable = executable
        self._handlers: list[Any] | None = None
        self.path = PathChoice(
            "dispatch", PathKind.FAST, "execute_sharded with one result handler per output"
        )
        try:
            from jax._src import core

            make = xla_client.array_result_handler
            with x64_scope():
                self._handlers = [
                    make(core.ShapedArray(shape, dtype), sharding, True, True)
                    for (shape, dtype), sharding in zip(outputs, shardings)
                ]
        # The handler API is internal to jax: missing (ImportError, AttributeError) or
        # with other arguments (TypeError). Anything else is a real error and propagates.
        except (ImportError, AttributeError, TypeError) as e:
            if partitioned:
                # execute() returns one array per device and result; a data-parallel
                # program needs the handlers to reassemble them.
                raise
            self._handlers = None
            reason = f"jaxlib's result handlers are unavailable ({type(e).__name__}: {e})"
            self.path = PathChoice("dispatch", PathKind.FALLBACK, reason)
            warn_once(
                "dispatch",
                "stepbundle runs steps through LoadedExecutable.execute, which builds "
                f"every result twice: {reason}. Steps are correct but slower; please "
                f"report this with your jax version ({jax.__version__}).",
                stacklevel=4,
            )

    def __call__(self, args: list[Array]) -> list[Array]:
        if self._handlers is not None:
            return list(self.executable.execute_sharded(args).consume_with_handlers(self._handlers))
        return list(self.executable.execute(args))


def block(arrays: Iterator[Array] | Sequence[Array]) -> None:
    for a in arrays:
        a.block_until_ready()
