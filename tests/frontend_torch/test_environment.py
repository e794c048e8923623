"""The torch front-end runs where torch_xla is absent, with current torch, from the CLI too."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from cli_here import cli_here

import stepbundle.schema as codec
from stepbundle.export_torch import NO_TORCH_XLA
from stepbundle.runtime import LoadOptions

ROOT = Path(__file__).resolve().parents[2]


def test_this_environment_has_current_torch_and_no_torch_xla() -> None:
    assert importlib.util.find_spec("torch_xla") is None
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert (major, minor) >= (2, 10), torch.__version__


def test_an_export_imports_no_torch_xla(exported: Any) -> None:
    path = exported("linear_adamw:recipe")
    assert "torch_xla" not in sys.modules
    assert not any(m.startswith("torch_xla") for m in sys.modules)
    with codec.open_bundle(path) as b:
        producer = b.manifest.producer
    assert producer.torch_xla == NO_TORCH_XLA
    assert producer.torch == str(torch.__version__)


def test_the_cli_chooses_this_front_end_and_writes_the_same_bytes(
    exported: Any, tmp_path: Path
) -> None:
    # The export through the CLI's main in this process: a child would spend its seconds
    # importing torch and jax (tests/frontends/test_frontends_export_check.py runs
    # `python -m stepbundle export` in a child, in this environment too). The refusal
    # below stays a child process: it imports neither.
    out = tmp_path / "cli.stepbundle"
    done = cli_here("export", f"{ROOT / 'examples' / 'linear_adamw.py'}:recipe", "-o", str(out))
    code, err = done.returncode, done.stderr
    assert code == 0, err[-2000:]
    assert "[export] front-end: torch (torch_xla is not installed)" in err
    # Writing is deterministic: the CLI's bundle is byte for byte the API's.
    assert out.read_bytes() == exported("linear_adamw:recipe").read_bytes()
    refused = subprocess.run(
        [sys.executable, "-m", "stepbundle", "export", "examples/linear_adamw.py:recipe",
         "-o", str(tmp_path / "x.stepbundle"), "--frontend", "torch_xla"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "The torch_xla front-end needs torch and torch_xla" in refused.stderr
    assert "pip install 'stepbundle[export]'" in refused.stderr


def test_a_bundle_without_weights_and_with_metadata(exported: Any, tmp_path: Path) -> None:
    """``include_state=False`` and ``metadata`` mean the same here as with torch_xla: the
    weights-free bundle started from the model's own state_dict runs the full bundle's
    steps bit for bit."""
    import linear_adamw
    import numpy as np

    from stepbundle.export_torch import export
    from stepbundle.runtime import load
    from stepbundle.runtime.state.checkpoint import write_safetensors

    # The session's export of the recipe (the same bytes as a fresh one: writing is
    # deterministic, as the CLI test above checks).
    full, free = exported("linear_adamw:recipe"), tmp_path / "free.stepbundle"
    recipe = linear_adamw.recipe()
    recipe.include_state = False
    recipe.metadata = {"name": "linear", "team": "tests"}
    export(recipe, free)
    with codec.open_bundle(free) as b:
        m = b.manifest
        kinds = {s.name: m.section(s.section).kind for s in m.state}
    assert m.metadata == {"name": "linear", "team": "tests"}
    assert codec.STATE_INITIALIZERS in m.required_features
    assert kinds["weight"] is codec.SectionKind.EXTERNAL
    assert kinds["optimizer.state.weight.exp_avg"] is codec.SectionKind.FILL
    assert free.stat().st_size < full.stat().st_size
    weights = {k: v.detach().numpy() for k, v in recipe.model.state_dict().items()}
    write_safetensors(tmp_path / "model.safetensors", weights)
    batch = {k: v.numpy() for k, v in recipe.example_batch.items()}
    runs = []
    for path, kw in ((full, {}), (free, {"init_from": tmp_path / "model.safetensors"})):
        t = load(path, options=LoadOptions.from_keywords(**kw))
        losses = [np.asarray(t.step(batch)["loss"]).tobytes() for _ in range(3)]
        runs.append((losses, {k: v.tobytes() for k, v in t.state_dict().items()}))
    assert runs[0] == runs[1]
