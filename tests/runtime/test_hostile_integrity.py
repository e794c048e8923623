"""Integrity and pinning: damage is caught before first use, and a digest pins a bundle.

- A flipped byte in any section is refused with an IntegrityError naming that section,
  by ``Bundle.section`` and by ``runtime.load``, before the bytes reach the MLIR parser
  or become a tensor.
- A flipped manifest byte is refused by the header's digest before the manifest is
  decoded: no field of a damaged manifest is ever read.
- ``Bundle.digest`` is FORMAT.md's definition, changes with any section, and is what
  ``inspect --json`` prints, what ``SafetyOptions(expect_digest=...)`` and ``stepbundle run
  --expect-digest`` compare.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runtime_helpers import GOLDEN_DIR, GOLDEN_NAMES, golden_batches, golden_bundle

from stepbundle import cli
from stepbundle.runtime import BindingError, CompileOptions, LoadOptions, SafetyOptions, load
from stepbundle.schema import (
    ConstantInput,
    IntegrityError,
    SectionKind,
    SectionPayload,
    open_bundle,
    write_bundle,
)
from stepbundle.schema import reader as codec_module
from stepbundle.schema.layout import HEADER_SIZE

# The modules, not the function ``stepbundle.runtime.load`` that shadows the first.
LOAD_MODULE = importlib.import_module("stepbundle.runtime.load")
PROGRAM_MODULE = importlib.import_module("stepbundle.runtime.compile.validate")


def _sections(name: str) -> list[tuple[str, SectionKind, int, int]]:
    with open_bundle(golden_bundle(name)) as b:
        return [(s.name, s.kind, b.data_start + s.offset, s.length) for s in b.manifest.sections]


def _used_by_load(name: str) -> set[str]:
    """The sections runtime.load reads: every program, state tensor and constant."""
    with open_bundle(golden_bundle(name)) as b:
        m = b.manifest
        used = {s.section for s in m.state}
        for entry in m.entries.values():
            for p in entry.programs:
                used.add(p.section)
                used.update(i.section for i in p.inputs if isinstance(i, ConstantInput))
    return used


CASES = [
    (name, section, kind, start, length)
    for name in GOLDEN_NAMES
    for (section, kind, start, length) in _sections(name)
]


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Record every byte string the loader hands to the MLIR parser or turns into a tensor."""
    seen: list[bytes] = []
    parse, to_array = PROGRAM_MODULE.mlir.parse_artifact, LOAD_MODULE.array_from_section

    def spy_parse(data: Any) -> Any:
        seen.append(bytes(data))
        return parse(data)

    def spy_array(data: Any, spec: Any) -> Any:
        seen.append(bytes(data))
        return to_array(data, spec)

    monkeypatch.setattr(PROGRAM_MODULE.mlir, "parse_artifact", spy_parse)
    monkeypatch.setattr(LOAD_MODULE, "array_from_section", spy_array)
    return seen


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xla-cache")


def test_every_golden_section_is_used_by_load() -> None:
    # Otherwise the next test would not show that load checks every section.
    for name in GOLDEN_NAMES:
        assert _used_by_load(name) == {s for s, *_ in _sections(name)}


@pytest.mark.parametrize(
    ("name", "section", "kind", "start", "length"),
    CASES,
    ids=[f"{c[0]}:{c[1]}" for c in CASES],
)
def test_a_flipped_byte_in_any_section_is_caught_before_first_use(
    tmp_path: Path,
    spies: list[bytes],
    cache: Path,
    name: str,
    section: str,
    kind: SectionKind,
    start: int,
    length: int,
) -> None:
    data = bytearray(golden_bundle(name).read_bytes())
    data[start + length // 2] ^= 0x20
    damaged = bytes(data[start : start + length])
    path = tmp_path / "damaged.stepbundle"
    path.write_bytes(bytes(data))

    with open_bundle(path) as bundle:  # the header and manifest are intact
        with pytest.raises(IntegrityError, match=f"Section {re.escape(repr(section))}"):
            bundle.section(section)
        assert [f for f in bundle.verify() if repr(section) in f]

    with pytest.raises(IntegrityError, match=f"Section {re.escape(repr(section))}") as info:
        load(path, options=LoadOptions(compile=CompileOptions(cache_dir=cache)))
    assert "damaged" in str(info.value)
    # The damaged bytes never reached the parser and never became a tensor.
    assert damaged not in spies


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_a_flipped_manifest_byte_is_caught_before_any_field_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    decoded: list[bytes] = []
    unpack = codec_module._unpack

    def spy(data: bytes) -> object:
        decoded.append(data)
        return unpack(data)

    monkeypatch.setattr(codec_module, "_unpack", spy)
    original = golden_bundle(name).read_bytes()
    length = int.from_bytes(original[16:24], "little")
    path = tmp_path / "damaged.stepbundle"
    for position in range(HEADER_SIZE, HEADER_SIZE + length, max(1, length // 40)):
        data = bytearray(original)
        data[position] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match="does not match the SHA-256 in its header"):
            open_bundle(path)
        with pytest.raises(IntegrityError, match="does not match the SHA-256 in its header"):
            load(path)
    assert decoded == []
    with open_bundle(golden_bundle(name)):  # the spy works: an intact bundle is decoded
        assert len(decoded) == 1


# -- the digest --------------------------------------------------------------------------


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_the_digest_is_the_format_md_definition(name: str) -> None:
    raw = golden_bundle(name).read_bytes()
    length = int.from_bytes(raw[16:24], "little")
    want = "sha256:" + hashlib.sha256(raw[: HEADER_SIZE + length]).hexdigest()
    with open_bundle(golden_bundle(name)) as b:
        assert b.digest == want
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", want)


def test_the_digest_changes_with_any_section(tmp_path: Path) -> None:
    # Sections are pinned through their digests in the manifest: rewriting one section
    # with a consistent digest still gives another bundle digest.
    with open_bundle(golden_bundle("linear_adamw")) as b:
        manifest, digest = b.manifest, b.digest
        payloads = [
            SectionPayload(s.name, s.kind, bytes(b.section(s.name))) for s in manifest.sections
        ]
    digests = {digest}
    for i, p in enumerate(payloads):
        if p.kind is not SectionKind.TENSOR:
            continue
        changed = bytearray(p.data)
        changed[0] ^= 0x01
        edited = [*payloads[:i], SectionPayload(p.name, p.kind, bytes(changed)), *payloads[i + 1 :]]
        path = tmp_path / f"edited{i}.stepbundle"
        write_bundle(path, manifest, edited)
        with open_bundle(path) as e:
            assert e.verify() == []
            digests.add(e.digest)
    n_tensors = sum(p.kind is SectionKind.TENSOR for p in payloads)
    assert len(digests) == 1 + n_tensors


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_inspect_json_gives_the_digest_at_the_top(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["inspect", str(golden_bundle(name)), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    with open_bundle(golden_bundle(name)) as b:
        assert described["digest"] == b.digest
    assert next(iter(described)) == "digest"
    assert cli.main(["inspect", str(golden_bundle(name))]) == 0
    assert f"digest    {described['digest']}" in capsys.readouterr().out


def test_load_with_expect_digest(tmp_path: Path) -> None:
    pinned = golden_bundle("linear_adamw")
    other = golden_bundle("dropout_sgd")
    with open_bundle(pinned) as b:
        digest = b.digest
    with open_bundle(other) as b:
        other_digest = b.digest
    trainer = load(
        pinned,
        options=LoadOptions(safety=SafetyOptions(expect_digest=digest)),
    )
    assert trainer.digest == digest
    trainer.step(golden_batches("linear_adamw")[0])
    with pytest.raises(BindingError) as info:
        load(
            other,
            options=LoadOptions(safety=SafetyOptions(expect_digest=digest)),
        )
    assert digest in str(info.value) and other_digest in str(info.value)
    # A digest spelled another way is another digest: no normalisation, no prefix match.
    for spelling in (digest.upper(), digest[len("sha256:") :], digest[:40]):
        with pytest.raises(BindingError, match="Refusing to run"):
            load(
                pinned,
                options=LoadOptions(
                    safety=SafetyOptions(expect_digest=spelling),
                ),
            )


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepbundle", "run", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_run_expect_digest_refuses_another_bundle_and_accepts_its_own() -> None:
    pinned, other = golden_bundle("dropout_sgd"), golden_bundle("linear_adamw")
    with open_bundle(pinned) as b:
        digest = b.digest
    with open_bundle(other) as b:
        other_digest = b.digest
    data = str(GOLDEN_DIR / "linear_adamw.inputs.npz")
    refused = _run_cli(str(other), "--steps", "2", "--data", data, "--expect-digest", digest)
    assert refused.returncode != 0
    assert digest in refused.stderr and other_digest in refused.stderr
    assert refused.stdout == ""  # not a single step ran
    data = str(GOLDEN_DIR / "dropout_sgd.inputs.npz")
    accepted = _run_cli(str(pinned), "--steps", "2", "--data", data,
                        "--expect-digest", digest, "--json")  # fmt: skip
    assert accepted.returncode == 0, accepted.stderr
    assert [json.loads(line)["step"] for line in accepted.stdout.splitlines()] == [0, 1]
