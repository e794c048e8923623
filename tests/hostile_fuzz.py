"""Mutations of golden bundles, and the one property every outcome must have.

Used by the bounded fuzz test (tests/runtime/test_hostile_fuzz.py) and by the long
fuzzer (scripts/fuzz.py), so that both try the same damage and judge it the same way.

A mutation draws its choices from a ``Draw`` (hypothesis's ``st.data()`` in the tests, or
a seeded ``random.Random`` in the long fuzzer) and returns the damaged file's bytes with a
one-line description of what it did. ``exercise`` then opens the damaged file, reads
every section, verifies it and, if it opened, loads it with the runtime and runs one step.
The property: every outcome is a clean load or a refusal for the bundle's sake
(``BundleError``, or its state's, data's or device's root); never a ``UsageError`` (the
calls here are right: a damaged file must not read as the caller's mistake), never another
exception, never a hang (``time_limit``), never an allocation the file does not justify
(``exercise`` measures the reader's peak with tracemalloc).

No torch here: the runtime tests that use this module also run in the lean environment.
"""

from __future__ import annotations

import copy
import math
import random
import signal
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import msgpack
from runtime_helpers import GOLDEN_DIR

from stepbundle.runtime import CompileOptions, LoadOptions, SafetyOptions
from stepbundle.schema import BundleError, IntegrityError, open_bundle
from stepbundle.schema.errors import CheckpointError, DataError, DeviceError
from stepbundle.schema.layout import HEADER_FORMAT, HEADER_SIZE, align, pack_header
from stepbundle.schema.wire import manifest_to_wire

GOLDEN_NAMES = ("linear_adamw", "dropout_sgd", "batchnorm_lr")

T = TypeVar("T")


class Draw(Protocol):
    """Where a mutation gets its choices from."""

    def integer(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        ...

    def blob(self, lo: int, hi: int) -> bytes:
        """Between lo and hi arbitrary bytes."""
        ...


def choice(draw: Draw, items: Sequence[T]) -> T:
    return items[draw.integer(0, len(items) - 1)]


class RandomDraw:
    """A ``Draw`` from a seeded ``random.Random`` (the long fuzzer's engine)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def blob(self, lo: int, hi: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(lo, hi))


class HypothesisDraw:
    """A ``Draw`` from hypothesis's ``st.data()`` (shrinks when a case fails)."""

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self._data = data
        self._st = st

    def integer(self, lo: int, hi: int) -> int:
        return int(self._data.draw(self._st.integers(lo, hi)))

    def blob(self, lo: int, hi: int) -> bytes:
        return bytes(self._data.draw(self._st.binary(min_size=lo, max_size=hi)))


# ---------------------------------------------------------------------------------------
# The file's parts
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Golden:
    """One golden bundle, split into the parts the mutations edit."""

    name: str
    data: bytes
    manifest_bytes: bytes
    wire: dict[str, Any]

    @property
    def data_area(self) -> bytes:
        return self.data[align(HEADER_SIZE + len(self.manifest_bytes)) :]


def load_golden(name: str) -> Golden:
    data = (GOLDEN_DIR / f"{name}.stepbundle").read_bytes()
    length = int.from_bytes(data[16:24], "little")
    path = GOLDEN_DIR / f"{name}.stepbundle"
    with open_bundle(path) as bundle:
        wire = manifest_to_wire(bundle.manifest)
    return Golden(name, data, data[HEADER_SIZE : HEADER_SIZE + length], wire)


def assemble_file(manifest_bytes: bytes, data_area: bytes) -> bytes:
    """Header (with the manifest's true digest) + manifest + zero padding + data area."""
    padding = bytes(align(HEADER_SIZE + len(manifest_bytes)) - HEADER_SIZE - len(manifest_bytes))
    return pack_header(manifest_bytes) + manifest_bytes + padding + data_area


def pack_wire(wire: Any) -> bytes:
    data = msgpack.packb(wire, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


# ---------------------------------------------------------------------------------------
# Byte-level damage: the digest catches what it should
# ---------------------------------------------------------------------------------------

# Values that break assumptions about integers: signs, the int64/uint64 edges, the
# sizes the format caps, and sizes far beyond any file.
HOSTILE_INTS: tuple[int, ...] = (
    0, 1, -1, 63, 64, 65, -64, 2**16 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1,
    2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 64 * 1024 * 1024 + 1,
)  # fmt: skip

HOSTILE_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1.5, math.nan, math.inf, -0.0, 2**63, 2**64 - 1, -(2**63),
    "", "x", "\x00", "é\u202e", "a" * 300, b"\x00\x01", [], [None], [2**62, 2**62], {},
    {"kind": "batch"}, {"kind": "nonsense"}, {"": 1}, [[[[[]]]]],
)  # fmt: skip

_HEADER_FIELDS = ("major", "minor", "reserved", "manifest_length", "reserved2")


def _region(draw: Draw, golden: Golden) -> tuple[int, int]:
    """A region of the file to damage: header, manifest, padding or data area."""
    length = len(golden.manifest_bytes)
    data_start = align(HEADER_SIZE + length)
    regions = [(0, HEADER_SIZE), (HEADER_SIZE, HEADER_SIZE + length), (0, len(golden.data))]
    if data_start > HEADER_SIZE + length:
        regions.append((HEADER_SIZE + length, data_start))
    if len(golden.data) > data_start:
        regions.append((data_start, len(golden.data)))
    return choice(draw, regions)


def flip_bytes(draw: Draw, golden: Golden) -> tuple[bytes, str]:
    data = bytearray(golden.data)
    lo, hi = _region(draw, golden)
    where = []
    for _ in range(draw.integer(1, 8)):
        i = draw.integer(lo, hi - 1)
        data[i] ^= draw.integer(1, 255)
        where.append(i)
    return bytes(data), f"flip bytes at {where}"


def truncate(draw: Draw, golden: Golden) -> tuple[bytes, str]:
    lo, hi = _region(draw, golden)
    cut = draw.integer(lo, hi - 1)
    return golden.data[:cut], f"truncate to {cut} bytes"


def append(draw: Draw, golden: Golden) -> tuple[bytes, str]:
    extra = draw.blob(1, 200) if draw.integer(0, 1) else bytes(draw.integer(1, 200))
    return golden.data + extra, f"append {len(extra)} bytes"


def insert(draw: Draw, golden: Golden) -> tuple[bytes, str]:
    lo, hi = _region(draw, golden)
    i = draw.integer(lo, hi)
    extra = draw.blob(1, 64)
    return golden.data[:i] + extra + golden.data[i:], f"insert {len(extra)} bytes at {i}"


def header_field(draw: Draw, golden: Golden) -> tuple[bytes, str]:
    import struct

    fmt = struct.Struct(HEADER_FORMAT)
    fields = list(fmt.unpack(golden.data[:HEADER_SIZE]))
    index = draw.integer(1, 6)
    if index == 5:  # the manifest digest
        fields[5] = draw.blob(32, 32)
        what = "manifest digest"
    else:
        bits = {1: 16, 2: 16, 3: 32, 4: 64, 6: 64}[index]
        pool = [v for v in HOSTILE_INTS if 0 <= v < 2**bits]
        pool += [fields[index] + 1, max(fields[index] - 1, 0), len(golden.data)]
        fields[index] = choice(draw, pool) % 2**bits
        what = f"{_HEADER_FIELDS[[1, 2, 3, 4, 6].index(index)]} = {fields[index]}"
    return fmt.pack(*fields) + golden.data[HEADER_SIZE:], f"header {what}"


# ---------------------------------------------------------------------------------------
# Manifest damage past the digest: the decoder and the validator see it
# ---------------------------------------------------------------------------------------


def _nodes(wire: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, wire
    if isinstance(wire, dict):
        for k, v in wire.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(wire, list):
        for i, v in enumerate(wire):
            yield from _nodes(v, (*path, i))


def _get(wire: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        wire = wire[key]
    return wire


def _strings(wire: Any) -> list[str]:
    return sorted({v for _, v in _nodes(wire) if isinstance(v, str)})


def _edit(draw: Draw, wire: dict[str, Any]) -> str:
    """Apply one random edit to ``wire`` in place; return what it did."""
    nodes = [(p, v) for p, v in _nodes(wire) if p]
    path, value = choice(draw, nodes)
    parent = _get(wire, path[:-1])
    key = path[-1]
    where = "/".join(map(str, path))
    op = draw.integer(0, 7)
    if op == 0:  # a value of any type
        new = copy.deepcopy(choice(draw, HOSTILE_VALUES))
        parent[key] = new
        return f"{where} = {new!r:.60}"
    if op == 1:  # delete: a missing required field, or a shorter list
        del parent[key]
        return f"delete {where}"
    if op == 2:  # an unknown key, or a duplicated list element (duplicate names)
        if isinstance(parent, dict):
            parent[f"unknown_{draw.integer(0, 9)}"] = copy.deepcopy(value)
            return f"add unknown key beside {where}"
        parent.insert(draw.integer(0, len(parent)), copy.deepcopy(value))
        return f"duplicate {where}"
    if op == 3 and isinstance(parent, list) and len(parent) > 1:  # reorder
        j = draw.integer(0, len(parent) - 1)
        parent[key], parent[j] = parent[j], parent[key]
        return f"swap {where} with [{j}]"
    if op == 4 and isinstance(value, int) and not isinstance(value, bool):
        pool = [*HOSTILE_INTS, value + 1, value - 1, value + 64, value - 64, value * 2, -value]
        parent[key] = choice(draw, pool)
        return f"{where}: {value} -> {parent[key]}"
    if op == 5 and isinstance(value, str):  # another name: dangling or duplicate references
        parent[key] = choice(draw, [*_strings(wire), "", value + "x", value.upper()])
        return f"{where}: {value!r:.40} -> {parent[key]!r:.40}"
    if op == 6 and isinstance(value, list) and all(isinstance(d, int) for d in value):
        shapes: list[list[int]] = [
            [2**31, 2**31], [2**62], [2**63 - 1, 2], [-1], [0], [1] * 65, [*value, 1],
            value[:-1], [2**60 // 4],
        ]  # fmt: skip
        parent[key] = choice(draw, shapes)
        return f"{where}: shape {value} -> {parent[key]}"
    if op == 7 and isinstance(parent, dict) and key == "kind":
        kinds = ["parameter", "buffer", "optimizer_state", "gradient", "batch", "rng_seed"]
        kinds += ["hyperparameter", "constant", "metric", "state_update", "program", "tensor"]
        kinds += ["text", "f32", "i64"]
        parent[key] = choice(draw, kinds)
        return f"{where}: kind {value!r} -> {parent[key]!r}"
    new = copy.deepcopy(choice(draw, HOSTILE_VALUES))
    parent[key] = new
    return f"{where} = {new!r:.60}"


def manifest_fields(draw: Draw, golden: Golden) -> tuple[bytes, str]:
    """Edit 1-3 manifest fields, re-encode, and give the header the new digest."""
    wire = copy.deepcopy(golden.wire)
    done = [_edit(draw, wire) for _ in range(draw.integer(1, 3))]
    return assemble_file(pack_wire(wire), golden.data_area), "; ".join(done)


_SAME_SIZE_DTYPES = (("f32", "i32", "u32"), ("f64", "i64", "u64"), ("bf16", "f16", "i16", "u16"))


def _coherent_edit(draw: Draw, wire: dict[str, Any]) -> str:
    """An edit made everywhere at once, so that it often passes validation and reaches
    the runtime's own checks (signatures, bindings, donation, values)."""
    op = draw.integer(0, 9)
    nodes = list(_nodes(wire))
    if op == 0:  # rename a name everywhere (or merge it into another name)
        keys = ("name", "state", "section")
        names = [v for p, v in nodes if p and p[-1] in keys and isinstance(v, str) and v]
        old = choice(draw, sorted(set(names)))
        new = choice(draw, [old + "_renamed", *sorted(set(names))])
        for p, v in nodes:
            if v == old and p and p[-1] in keys:
                _get(wire, p[:-1])[p[-1]] = new
        return f"rename {old!r} -> {new!r} everywhere"
    if op == 1:  # the same byte size, another shape, wherever the shape appears
        shapes = [v for p, v in nodes if p and p[-1] == "shape" and len(v) >= 1]
        old = choice(draw, shapes)
        numel = math.prod(old)
        new = choice(draw, [old[::-1], [numel], [1, *old], [numel, 1]])
        for p, v in nodes:
            if p and p[-1] == "shape" and v == old:
                _get(wire, p[:-1])["shape"] = list(new)
        return f"shape {old} -> {new} everywhere"
    if op == 2:  # another dtype of the same item size, wherever it appears
        group = choice(draw, _SAME_SIZE_DTYPES)
        old, new = choice(draw, group), choice(draw, group)
        for p, v in nodes:
            if p and p[-1] == "dtype" and v == old:
                _get(wire, p[:-1])["dtype"] = new
        return f"dtype {old} -> {new} everywhere"
    if op == 3 and wire["hyperparameters"]:
        h = choice(draw, wire["hyperparameters"])
        h["value"] = choice(draw, [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 0.0])
        return f"hyperparameter {h['name']!r} = {h['value']}"
    if op == 4 and wire["rng"] is not None:
        wire["rng"]["seed"] = choice(draw, [0, 1, 2**63 - 1, 2**63, 2**64 - 1])
        return f"rng seed = {wire['rng']['seed']}"
    programs = [p for e in wire["entries"].values() for p in e["programs"]]
    program = choice(draw, programs)
    if op == 5:  # donation moved, dropped or pointed elsewhere
        updates = [o for o in program["outputs"] if o["kind"] == "state_update"]
        if updates:
            o = choice(draw, updates)
            o["donates"] = choice(draw, [None, 0, len(program["inputs"]) - 1, o["donates"]])
            return f"{o['state']!r} donates {o['donates']}"
    if op == 6:  # two inputs of the same spec trade places
        by_spec: dict[str, list[int]] = {}
        for i, b in enumerate(program["inputs"]):
            by_spec.setdefault(repr(b["spec"]), []).append(i)
        pairs = [v for v in by_spec.values() if len(v) > 1]
        if pairs:
            i, j = choice(draw, pairs)[:2]
            inputs = program["inputs"]
            inputs[i], inputs[j] = inputs[j], inputs[i]
            return f"inputs {i} and {j} swapped"
    if op == 7:
        program["platforms"] = choice(draw, [["cpu"], ["tpu"], ["cuda", "rocm"], []])
        return f"platforms = {program['platforms']}"
    if op == 8:
        program["stablehlo_version"] = choice(draw, ["0.0.0", "99.99.99", "1.0.0"])
        return f"stablehlo_version = {program['stablehlo_version']}"
    if op == 9 and len(wire["entries"]) > 1:
        name = choice(draw, sorted(wire["entries"]))
        del wire["entries"][name]
        return f"entry {name!r} removed"
    wire["required_features"] = choice(draw, [["stepbundle.future"], []])
    return f"required_features = {wire['required_features']}"


def manifest_coherent(draw: Draw, golden: Golden) -> tuple[bytes, str]:
    """1-2 coherent manifest edits, re-encoded with a matching digest."""
    wire = copy.deepcopy(golden.wire)
    done = [_coherent_edit(draw, wire) for _ in range(draw.integer(1, 2))]
    return assemble_file(pack_wire(wire), golden.data_area), "; ".join(done)


def manifest_bytes(draw: Draw, golden: Golden) -> tuple[bytes, str]:
    """Damage the msgpack bytes themselves, with a matching digest."""
    raw = bytearray(golden.manifest_bytes)
    where = []
    for _ in range(draw.integer(1, 4)):
        i = draw.integer(0, len(raw) - 1)
        raw[i] = draw.integer(0, 255)
        where.append(i)
    if draw.integer(0, 3) == 0:
        del raw[draw.integer(0, len(raw) - 1) :]
        where.append(len(raw))
    return assemble_file(bytes(raw), golden.data_area), f"manifest bytes edited at {where}"


def tensor_data(draw: Draw, golden: Golden) -> tuple[bytes, str]:
    """Change a tensor section and record its new digest: it must load (any values)."""
    import hashlib

    wire = copy.deepcopy(golden.wire)
    tensors = [s for s in wire["sections"] if s["kind"] == "tensor" and s["length"] > 0]
    section = choice(draw, tensors)
    area = bytearray(golden.data_area)
    start = section["offset"]
    for _ in range(draw.integer(1, 4)):
        area[start + draw.integer(0, section["length"] - 1)] = draw.integer(0, 255)
    section["sha256"] = hashlib.sha256(area[start : start + section["length"]]).hexdigest()
    return assemble_file(pack_wire(wire), bytes(area)), f"tensor {section['name']!r} rewritten"


MUTATIONS: dict[str, Callable[[Draw, Golden], tuple[bytes, str]]] = {
    "flip": flip_bytes,
    "truncate": truncate,
    "append": append,
    "insert": insert,
    "header": header_field,
    "manifest_fields": manifest_fields,
    "manifest_coherent": manifest_coherent,
    "manifest_bytes": manifest_bytes,
    "tensor_data": tensor_data,
}


@dataclass(frozen=True)
class Case:
    """One damaged file: which golden it came from, how, and its bytes."""

    golden: str
    mutation: str
    description: str
    data: bytes
    stop_on_nonfinite: bool  # load it in the mode that checks every step's loss


def mutate(draw: Draw, goldens: Sequence[Golden]) -> Case:
    """A damaged copy of one of ``goldens``."""
    golden = choice(draw, goldens)
    name = choice(draw, sorted(MUTATIONS))
    data, what = MUTATIONS[name](draw, golden)
    stop = bool(draw.integer(0, 1))
    return Case(golden.name, name, f"{golden.name}, {name}: {what}", data, stop)


# ---------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------


class CaseTimeout(BaseException):
    """A case ran past its time limit (a BaseException, so no ``except Exception`` in
    the code under test can swallow it)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``CaseTimeout`` in the main thread after ``seconds`` (SIGALRM)."""

    def expire(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"the case ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# The reader may allocate the manifest's decoded form and small bookkeeping, nothing in
# proportion to sizes the manifest merely names.
READER_ALLOCATION_LIMIT = 8 * 1024 * 1024


@dataclass
class Outcome:
    """What happened to one damaged file."""

    stage: str  # "open", "load", "step" or "ok"
    error: str | None  # the BundleError subclass that refused it, if any
    reader_peak: int  # bytes tracemalloc saw at its peak while the reader ran


# What a damaged bundle may be refused with once it opened: its programs or tables
# (BundleError), its state (CheckpointError), what it asks of data or the device.
BUNDLE_REFUSALS = (BundleError, CheckpointError, DataError, DeviceError)


def exercise(
    path: Path,
    *,
    load: bool = True,
    cache_dir: Path | None = None,
    batch: dict[str, Any] | None = None,
    stop_on_nonfinite: bool = False,
) -> Outcome:
    """Open ``path``, read every section, verify, then load it and run ``batch``.

    Returns where a ``BundleError`` (opening) or a ``BUNDLE_REFUSALS`` (loading,
    stepping) stopped it (or "ok"); any other exception, ``UsageError`` included, escapes.
    """
    tracemalloc.start()
    try:
        try:
            bundle = open_bundle(path)
        except BundleError as e:
            return Outcome("open", type(e).__name__, tracemalloc.get_traced_memory()[1])
        with bundle:
            for section in bundle.manifest.sections:
                try:
                    view = bundle.section(section.name)
                except IntegrityError:
                    continue
                assert len(view) == section.length
                view.release()
            failures = bundle.verify()
            assert isinstance(failures, list)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if not load:
        return Outcome("ok", None, peak)
    from stepbundle.runtime import load as runtime_load

    try:
        trainer = runtime_load(
            path,
            options=LoadOptions(
                compile=CompileOptions(cache_dir=cache_dir if cache_dir is not None else False),
                safety=SafetyOptions(stop_on_nonfinite=stop_on_nonfinite),
            ),
        )
    except BUNDLE_REFUSALS as e:
        return Outcome("load", type(e).__name__, peak)
    if batch is not None:
        try:
            for value in trainer.step(batch).values():  # whatever the metrics are called
                value.block_until_ready()
            trainer.state_dict()
        except BUNDLE_REFUSALS as e:
            return Outcome("step", type(e).__name__, peak)
    return Outcome("ok", None, peak)
