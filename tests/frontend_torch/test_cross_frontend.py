"""Both front-ends write the same tables for the same recipe.

The torch_xla front-end exports in its own environment (.venv, a child process), the
torch front-end here; for each recipe the two bundles must have the same state table, the
same hyperparameters, and per entry and shape bucket the same inputs (names, kinds,
shapes and dtypes) and the same outputs in the same order, each state update donating the
input of the same state. Constants are left out: torch_xla lifts the step's Python
numbers (lr, betas, eps) into constant inputs, this front-end writes them into the program.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

import stepbundle.schema as codec
from stepbundle.export_torch import NO_TORCH_XLA

RECIPES = [
    "linear_adamw:recipe",  # the seed case
    "equiv_models:gpt_no_dropout",  # tied weights, two param groups, lr declared, clipping
    "torch_cases:mlp_two_buckets",  # BatchNorm buffers, an eval entry, two shape buckets
]
CHILD = Path(__file__).resolve().parent / "xla_export_child.py"


def tables(path: Path) -> dict[str, Any]:
    """What both front-ends must agree on, from a bundle's manifest."""
    with codec.open_bundle(path) as b:
        m = b.manifest
    progs = {}
    for name, entry in m.entries.items():
        for i, p in enumerate(entry.programs):
            key = [(x.kind.value, getattr(x, "name", None), str(x.spec)) for x in p.inputs]
            ins = sorted(k for k in key if k[0] != "constant")
            outs = [
                (o.kind.value, getattr(o, "name", getattr(o, "state", None)), str(o.spec),
                 None if getattr(o, "donates", None) is None else key[o.donates])
                for o in p.outputs
            ]  # fmt: skip
            progs[f"{name}/{i}"] = {"inputs": ins, "outputs": outs, "batch": p.batch}
    return {
        "state": [(s.name, s.kind.value, str(s.spec), s.trainable, s.aliases) for s in m.state],
        "hyperparameters": [(h.name, str(h.spec), h.value) for h in m.hyperparameters],
        "programs": progs,
        "entries": {n: e.updates_state for n, e in m.entries.items()},
        "rng": m.rng is not None,
        "producer": m.producer,
    }


@pytest.fixture(scope="module")
def bundles(
    xla_python: str, exported: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    xla_dir = tmp_path_factory.mktemp("xla")
    child = subprocess.Popen(
        [xla_python, str(CHILD), str(xla_dir), *RECIPES],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ours = {spec: exported(spec) for spec in RECIPES}  # while the other environment exports
    _, err = child.communicate(timeout=600)
    assert child.returncode == 0, f"the torch_xla export failed:\n{err[-3000:]}"
    return {
        spec.partition(":")[2]: (
            tables(xla_dir / f"{spec.partition(':')[2]}.stepbundle"),
            tables(ours[spec]),
        )
        for spec in RECIPES
    }


@pytest.mark.parametrize("spec", RECIPES)
def test_both_front_ends_write_the_same_tables(bundles: dict[str, Any], spec: str) -> None:
    xla, torch_ = bundles[spec.partition(":")[2]]
    for part in ("state", "hyperparameters", "entries", "rng"):
        assert torch_[part] == xla[part], part
    assert set(torch_["programs"]) == set(xla["programs"])
    for key, want in xla["programs"].items():
        got = torch_["programs"][key]
        assert got["batch"] == want["batch"], key
        assert got["inputs"] == want["inputs"], key
        assert got["outputs"] == want["outputs"], key
    # Not vacuous: the programs bind state, batch and updates, and the producers differ.
    some = xla["programs"]["train/0"]
    assert any(k[0] == "parameter" for k in some["inputs"])
    assert any(o[0] == "state_update" and o[3] is not None for o in some["outputs"])
    assert xla["producer"].torch_xla != NO_TORCH_XLA
    assert torch_["producer"].torch_xla == NO_TORCH_XLA
