"""The program is code: native calls off the allowlist and foreign platforms are refused.

A bundle's StableHLO may name ``custom_call`` targets, which XLA resolves to native
functions. The runtime refuses any target that is not on ``ALLOWED_CUSTOM_CALLS``,
wherever the call sits (``@main``, a private function, a loop body) and however its name
is spelled (quoted or escaped names print differently from plain ones). A program that
lists the platforms it needs is refused, with a clear message, on any other platform.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest
from jaxlib.mlir import ir
from runtime_helpers import golden_batches, golden_bundle

from stepbundle.runtime import (
    CompileOptions,
    DeviceError,
    LoadOptions,
    PlatformError,
    StateOptions,
    load,
)
from stepbundle.schema import (
    BundleError,
    Entry,
    Manifest,
    SchemaValidationError,
    SectionPayload,
    open_bundle,
    write_bundle,
)
from stepbundle.stablehlo import artifact as mlir

_MLIR_TYPES = {"bool": "i1", "u8": "ui8", "u16": "ui16", "u32": "ui32", "u64": "ui64"}


def _tensor_type(dtype: str, shape: tuple[int, ...]) -> str:
    element = _MLIR_TYPES.get(dtype, dtype)
    return f"tensor<{''.join(f'{d}x' for d in shape)}{element}>"


def _golden_parts(name: str) -> tuple[Manifest, list[SectionPayload]]:
    with open_bundle(golden_bundle(name)) as b:
        payloads = [
            SectionPayload(s.name, s.kind, bytes(b.section(s.name))) for s in b.manifest.sections
        ]
        return b.manifest, payloads


def _with_program_text(tmp_path: Path, edit: str | None, helper: str = "") -> Path:
    """linear_adamw with train program 0 rewritten: ``edit`` is a line inserted before
    @main's return (``{arg0}`` and ``{t0}`` name @main's first argument and its type),
    ``helper`` a function inserted before @main. Written with write_bundle, so every
    digest is right: only the runtime's own checks can refuse it."""
    manifest, payloads = _golden_parts("linear_adamw")
    program = manifest.entries["train"].programs[0]
    index = next(i for i, p in enumerate(payloads) if p.name == program.section)
    module = mlir.parse_artifact(payloads[index].data)
    dtype, shape = module.signature().inputs[0]
    text = module.text()
    if edit is not None or helper:
        main_at = text.index("func.func @main")
        return_at = text.index("\n    return ", main_at)
        line = (edit or "").format(arg0="%arg0", t0=_tensor_type(dtype, shape))
        text = (
            text[:main_at] + helper.format(t0=_tensor_type(dtype, shape)) + text[main_at:return_at]
            + ("\n    " + line if line else "") + text[return_at:]
        )  # fmt: skip
    # The context the artifact was read into has every dialect the text uses loaded.
    context = module._ctx
    with context:
        rewritten = mlir.Module(context, ir.Module.parse(text))
    artifact = rewritten.portable_artifact(program.stablehlo_version)
    payloads[index] = SectionPayload(program.section, payloads[index].kind, artifact)
    path = tmp_path / "rewritten.stepbundle"
    write_bundle(path, manifest, payloads)
    return path


def test_a_rewritten_program_without_custom_calls_loads_and_trains(tmp_path: Path) -> None:
    # The control for the tests below: the rewriting itself is harmless.
    trainer = load(_with_program_text(tmp_path, None))
    assert float(trainer.step(golden_batches("linear_adamw")[0])["loss"]) > 0


EVIL = "%evil = stablehlo.custom_call @{target}({{arg0}}) : ({{t0}}) -> {{t0}}"


@pytest.mark.parametrize(
    ("spelled", "target"),
    [
        ("evil_target", "evil_target"),
        ('"evil target"', "evil target"),  # printed quoted: @"evil target"
        ('"ev\\22il"', 'ev"il'),  # an escaped quote inside the name
        ("__cpu_function_pointer", "__cpu_function_pointer"),
    ],
)
def test_a_custom_call_off_the_allowlist_is_refused_at_load(
    tmp_path: Path, spelled: str, target: str
) -> None:
    path = _with_program_text(tmp_path, EVIL.format(target=spelled))
    with pytest.raises(SchemaValidationError) as info:
        load(path)
    assert isinstance(info.value, BundleError)
    assert repr(target) in str(info.value)
    assert "allowlist" in str(info.value)
    assert info.value.path == "entries.train.programs[0].section"


def test_a_custom_call_inside_a_private_function_is_refused(tmp_path: Path) -> None:
    helper = (
        "func.func private @helper(%a: {t0}) -> {t0} {{\n"
        "    %0 = stablehlo.custom_call @hidden_target(%a) : ({t0}) -> {t0}\n"
        "    return %0 : {t0}\n"
        "  }}\n  "
    )
    path = _with_program_text(
        tmp_path, "%evil = func.call @helper({arg0}) : ({t0}) -> {t0}", helper=helper
    )
    with pytest.raises(SchemaValidationError, match="'hidden_target'"):
        load(path)


def test_an_allowed_custom_call_loads_and_trains(tmp_path: Path) -> None:
    # The check refuses by name, not every custom call: mhlo.erf (GELU) is on the list,
    # and XLA lowers it on the CPU.
    assert "mhlo.erf" in mlir.ALLOWED_CUSTOM_CALLS
    path = _with_program_text(tmp_path, EVIL.format(target='"mhlo.erf"'))
    trainer = load(path)
    assert float(trainer.step(golden_batches("linear_adamw")[0])["loss"]) > 0


def test_host_transfer_ops_are_refused_at_load(tmp_path: Path) -> None:
    # An outfeed hands data to the host outside the step's results: never emitted by
    # the exporter, refused by the runtime.
    edit = (
        "%tok = stablehlo.create_token : !stablehlo.token\n"
        '    %out = "stablehlo.outfeed"({arg0}, %tok) : ({t0}, !stablehlo.token) -> !stablehlo.token'
    )
    path = _with_program_text(tmp_path, edit)
    with pytest.raises(SchemaValidationError, match=r"\['stablehlo.outfeed'\]") as info:
        load(path)
    assert info.value.path == "entries.train.programs[0].section"


def _with_platforms(tmp_path: Path, platforms: tuple[str, ...]) -> Path:
    manifest, payloads = _golden_parts("linear_adamw")
    entries = {
        name: Entry(
            tuple(dataclasses.replace(p, platforms=platforms) for p in entry.programs),
            entry.updates_state,
        )
        for name, entry in manifest.entries.items()
    }
    path = tmp_path / f"{'-'.join(platforms) or 'any'}.stepbundle"
    write_bundle(path, dataclasses.replace(manifest, entries=entries), payloads)
    return path


@pytest.mark.parametrize("platforms", [("tpu",), ("cuda", "rocm")])
def test_a_program_for_another_platform_is_refused_on_cpu(
    tmp_path: Path, platforms: tuple[str, ...]
) -> None:
    path = _with_platforms(tmp_path, platforms)
    with pytest.raises(PlatformError) as info:
        load(path, device="cpu")
    message = str(info.value)
    assert " or ".join(platforms) in message
    assert "on cpu" in message
    assert f"--device {platforms[0]}" in message
    assert isinstance(info.value, DeviceError) and not isinstance(info.value, BundleError)


@pytest.mark.parametrize("platforms", [("cpu",), ("cpu", "tpu"), ()])
def test_a_program_that_lists_cpu_or_nothing_runs_on_cpu(
    tmp_path: Path, platforms: tuple[str, ...]
) -> None:
    trainer = load(_with_platforms(tmp_path, platforms), device="cpu")
    assert float(trainer.step(golden_batches("linear_adamw")[0])["loss"]) > 0


def test_a_binding_table_that_disagrees_with_the_program_is_refused(tmp_path: Path) -> None:
    # The manifest says batch input 'x' is f32[8,6]; the program's @main takes f32[8,5].
    # Every digest is right and validate() passes: only the signature check catches it.
    from stepbundle.schema import BatchInput, NamedSpec, TensorSpec

    manifest, payloads = _golden_parts("linear_adamw")
    train = manifest.entries["train"]
    program = train.programs[0]
    wrong = TensorSpec(program.batch[0].spec.dtype, (8, 6))

    def fix(row: Any) -> Any:
        if isinstance(row, BatchInput) and row.name == "x":
            return dataclasses.replace(row, spec=wrong)
        return row

    edited = dataclasses.replace(
        program,
        inputs=tuple(fix(r) for r in program.inputs),
        batch=tuple(NamedSpec(b.name, wrong) if b.name == "x" else b for b in program.batch),
    )
    entries = {
        **manifest.entries,
        "train": Entry((edited, *train.programs[1:]), train.updates_state),
    }
    path = tmp_path / "mismatch.stepbundle"
    write_bundle(path, dataclasses.replace(manifest, entries=entries), payloads)
    index = next(
        i for i, r in enumerate(program.inputs) if isinstance(r, BatchInput) and r.name == "x"
    )
    with pytest.raises(
        SchemaValidationError, match=r"the binding table says f32\[8,6\] but @main's argument"
    ) as info:
        load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    assert info.value.path == f"entries.train.programs[0].inputs[{index}]"


def _with_program_bytes(tmp_path: Path, make: str) -> Path:
    """linear_adamw with train program 0's section replaced by another encoding of the
    same module (or by damaged bytes); every digest is right."""
    manifest, payloads = _golden_parts("linear_adamw")
    program = manifest.entries["train"].programs[0]
    index = next(i for i, p in enumerate(payloads) if p.name == program.section)
    portable = payloads[index].data
    module = mlir.parse_artifact(portable)
    if make == "text":
        data = module.text().encode()
    elif make == "bytecode":
        out = io.BytesIO()
        with module._ctx:
            module._module.operation.write_bytecode(out)
        data = out.getvalue()
    elif make == "truncated":
        data = bytes(portable[: len(portable) // 2])
    else:
        data = b"\x00\x01 not a program at all"
    payloads[index] = SectionPayload(program.section, payloads[index].kind, data)
    path = tmp_path / f"{make}.stepbundle"
    write_bundle(path, manifest, payloads)
    return path


@pytest.mark.parametrize(
    ("make", "found"),
    [
        ("text", "it is MLIR text, not a portable artifact"),
        ("bytecode", "it is plain MLIR bytecode (producer 'MLIR"),
        ("garbage", "it is not MLIR at all (it starts with 0001"),
        ("truncated", "could not be read by this jaxlib"),
    ],
)
def test_a_program_section_that_is_not_a_portable_artifact_is_refused(
    tmp_path: Path, make: str, found: str
) -> None:
    # FORMAT.md: a program section is a StableHLO portable artifact. Plain MLIR is tied
    # to the MLIR version that wrote it; it is refused, never parsed on a best effort.
    with pytest.raises(SchemaValidationError) as info:
        load(
            _with_program_bytes(tmp_path, make),
            options=LoadOptions(compile=CompileOptions(cache_dir=False)),
        )
    assert isinstance(info.value, BundleError)
    assert info.value.path == "entries.train.programs[0].section"
    message = str(info.value)
    assert found in message
    assert "must be a StableHLO portable artifact" in message
    assert "re-export the bundle" in message


def test_parse_artifact_refuses_plain_mlir_directly() -> None:
    # The exporter calls the same function on torch_xla's output: no silent fallback
    # there either.
    manifest, payloads = _golden_parts("linear_adamw")
    section = manifest.entries["train"].programs[0].section
    portable = next(p.data for p in payloads if p.name == section)
    module = mlir.parse_artifact(portable)
    with pytest.raises(mlir.ArtifactError, match="MLIR text"):
        mlir.parse_artifact(module.text().encode())
    with pytest.raises(mlir.ArtifactError, match="it is empty"):
        mlir.parse_artifact(b"")


def _with_transformed_text(tmp_path: Path, transform: Any) -> Path:
    """linear_adamw with every train and eval program's text passed through ``transform``."""
    manifest, payloads = _golden_parts("linear_adamw")
    for entry in manifest.entries.values():
        for program in entry.programs:
            index = next(i for i, p in enumerate(payloads) if p.name == program.section)
            module = mlir.parse_artifact(payloads[index].data)
            with module._ctx:
                rewritten = mlir.Module(module._ctx, ir.Module.parse(transform(module.text())))
            artifact = rewritten.portable_artifact(program.stablehlo_version)
            payloads[index] = SectionPayload(program.section, payloads[index].kind, artifact)
    path = tmp_path / "transformed.stepbundle"
    write_bundle(path, manifest, payloads)
    return path


def test_main_named_in_an_attribute_does_not_confuse_the_packing_wrapper(tmp_path: Path) -> None:
    # The wrapper that packs small state used to find @main by searching the printed
    # module; an attribute holding that text would have been taken for it.
    def plant(text: str) -> str:
        return text.replace(
            "func.func @main(",
            'func.func private @decoy() attributes {note = "func.func @main("} {\n    return\n  }\n  func.func @main(',
            1,
        )

    path = _with_transformed_text(tmp_path, plant)
    batch = golden_batches("linear_adamw")[0]
    want = float(
        load(
            golden_bundle("linear_adamw"),
            options=LoadOptions(compile=CompileOptions(cache_dir=False)),
        ).step(batch)["loss"]
    )
    packed = load(
        path,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=False), state=StateOptions(pack_state=True)
        ),
    )
    assert packed.load_info.compiled == 4
    assert float(packed.step(batch)["loss"]) == want


@pytest.mark.parametrize(
    ("name", "transform"),
    [
        ("no @main", lambda t: t.replace("func.func @main(", "func.func @step(", 1)),
        (
            "@main inside a nested module",
            lambda t: (
                t.replace("func.func @main(", "module @inner {\n  func.func @main(", 1).rstrip()[
                    :-1
                ]
                + "}\n}\n"
            ),
        ),
    ],
)
def test_a_program_without_a_public_main_is_a_bundle_error(
    tmp_path: Path, name: str, transform: Any
) -> None:
    path = _with_transformed_text(tmp_path, transform)
    with pytest.raises(BundleError) as refused:
        load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    assert "@main" in str(refused.value), name
