"""Builders shared by the schema tests: a tiny valid bundle and raw-byte surgery helpers."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import msgpack

from stepbundle.schema import (
    BatchInput,
    DType,
    Entry,
    Hyperparameter,
    HyperparameterInput,
    InputKind,
    Manifest,
    MetricOutput,
    NamedSpec,
    Producer,
    Program,
    Rng,
    RngSeedInput,
    SectionKind,
    SectionPayload,
    StateEntry,
    StateInput,
    StateKind,
    StateUpdateOutput,
    TensorSpec,
    write_bundle,
)
from stepbundle.schema.layout import HEADER_SIZE, align, pack_header
from stepbundle.schema.wire import manifest_to_wire

PROGRAM_BYTES = b"ML\xefR\x01stablehlo-portable-artifact-placeholder"
WEIGHT_BYTES = bytes(range(16))  # f32[2,2]


def spec(dtype: DType, *shape: int) -> TensorSpec:
    return TensorSpec(dtype, tuple(shape))


def tiny_manifest() -> Manifest:
    """A small but complete manifest: one state tensor, one program, a seed and an lr."""
    w = spec(DType.F32, 2, 2)
    program = Program(
        section="train.program",
        stablehlo_version="1.0.0",
        inputs=(
            StateInput(InputKind.PARAMETER, "w", w),
            BatchInput("x", spec(DType.F32, 2)),
            RngSeedInput(spec(DType.I64)),
            HyperparameterInput("lr", spec(DType.F64)),
        ),
        outputs=(
            MetricOutput("loss", spec(DType.F32)),
            StateUpdateOutput("w", w, donates=0),
        ),
        batch=(NamedSpec("x", spec(DType.F32, 2)),),
        platforms=("cpu",),
    )
    return Manifest(
        producer=Producer(stepbundle="0.1.0", torch="2.9.0", torch_xla="2.9.0", jax="0.7.1"),
        entries={"train": Entry(programs=(program,), updates_state=True)},
        state=(
            StateEntry(
                name="w", kind=StateKind.PARAMETER, spec=w, section="state.w", trainable=True
            ),
        ),
        hyperparameters=(Hyperparameter("lr", spec(DType.F64), 0.001),),
        rng=Rng(seed=42),
        sections=(),
    )


def tiny_payloads() -> list[SectionPayload]:
    return [
        SectionPayload("train.program", SectionKind.PROGRAM, PROGRAM_BYTES),
        SectionPayload("state.w", SectionKind.TENSOR, WEIGHT_BYTES),
    ]


def write_tiny(path: Path) -> Manifest:
    return write_bundle(path, tiny_manifest(), tiny_payloads())


def wire_of(manifest: Manifest) -> dict[str, Any]:
    """A deep, editable copy of the manifest's msgpack form."""
    return copy.deepcopy(manifest_to_wire(manifest))


def pack(wire: Any) -> bytes:
    data = msgpack.packb(wire, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def raw_bundle(manifest_bytes: bytes, data_area: bytes, version: tuple[int, int] = (1, 0)) -> bytes:
    """Header + manifest + padding + data area, with a correct manifest digest."""
    header = pack_header(manifest_bytes, version)
    padding = bytes(align(HEADER_SIZE + len(manifest_bytes)) - HEADER_SIZE - len(manifest_bytes))
    return header + manifest_bytes + padding + data_area


def data_area(file_bytes: bytes) -> bytes:
    """The data area of a well-formed bundle."""
    length = int.from_bytes(file_bytes[16:24], "little")
    return file_bytes[align(HEADER_SIZE + length) :]


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
