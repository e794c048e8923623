"""``stepbundle inspect``: a summary by default, the full table with ``--full``.

The expected values are computed here from the bundle's bytes with numpy (the summary
decodes them with ``struct``), and the parameter count from the state table's shapes.
Metadata (format 1.1) is written into a copy of a golden bundle and read back.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from runtime_helpers import golden_bundle

from stepbundle.cli.main import main
from stepbundle.schema import SectionPayload, open_bundle, write_bundle
from stepbundle.schema.errors import SchemaValidationError
from stepbundle.schema.manifest import ConstantInput, StateKind

NAME = "batchnorm_lr"  # constants, a hyperparameter, buffers and optimizer state
NUMPY = {"f32": "<f4", "f64": "<f8", "i64": "<i8"}


def _inspect(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["inspect", *args]) == 0
    return capsys.readouterr().out


def test_the_summary_says_what_the_bundle_takes_holds_and_froze(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = golden_bundle(NAME)
    out = _inspect(capsys, str(path))
    lines = out.splitlines()
    with open_bundle(path) as b:
        m = b.manifest
        assert f"digest    {b.digest}" in lines
        params = [s for s in m.state if s.kind is StateKind.PARAMETER]
        count = sum(math.prod(s.spec.shape) for s in params)
        assert any(line.startswith(f"parameters {count:,} ({count:,} trainable)") for line in lines)
        (lr,) = m.hyperparameters
        assert f"  lr = {lr.value!r} (f32[])" in lines
        assert "  batch    x: f32[10,4], y: f32[10,2]" in lines
        assert "  metrics  loss: f32[]" in lines
        constants = [
            (j, inp)
            for j, inp in enumerate(m.entries["train"].programs[0].inputs)
            if isinstance(inp, ConstantInput)
        ]
        assert len(constants) == 4
        for j, inp in constants:
            raw = b.section(inp.section).tobytes()
            value = np.frombuffer(raw, NUMPY[inp.spec.dtype.value])[0]
            want = f"    {inp.name} = {float(value):.6g} ({inp.spec}), input {j} of train[0]"
            assert want in lines, (want, out)
    assert "inputs (" not in out  # the binding table is --full's
    full = _inspect(capsys, str(path), "--full")
    assert "    inputs (34):" in full and "optimizer.state.0.weight.exp_avg_sq" in full


def test_metadata_is_carried_and_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with open_bundle(golden_bundle(NAME)) as b:
        payloads = [
            SectionPayload(s.name, s.kind, b.section(s.name).tobytes()) for s in b.manifest.sections
        ]
        meta = {"team": "vision", "name": "bn-demo", "source_commit": "3f2c1e0"}
        manifest = dataclasses.replace(b.manifest, metadata=meta)
        with pytest.raises(SchemaValidationError, match="metadata key must not be empty"):
            write_bundle(
                tmp_path / "bad.stepbundle",
                dataclasses.replace(manifest, metadata={"": "x"}),
                payloads,
            )
    out_path = tmp_path / "m.stepbundle"
    write_bundle(out_path, manifest, payloads)
    with open_bundle(out_path) as again:
        assert dict(again.manifest.metadata) == meta
    lines = _inspect(capsys, str(out_path)).splitlines()
    # name and source_commit first, in that order; other labels after them.
    shown = [line for line in lines if line.split(" ")[0] in meta]
    assert shown == ["name      bn-demo", "source_commit 3f2c1e0", "team      vision"]
    assert "metadata  team = vision" in _inspect(capsys, str(out_path), "--full")
