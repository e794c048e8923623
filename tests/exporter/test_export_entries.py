"""Entries, shape buckets, mixed precision and step variants, program format, CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import check_equivalent, mse_step, regression_batch
from support import make_batches, run_bundle_inprocess, to_numpy, train_eager_xla

from stepbundle.exporter import ExportError, Recipe, export
from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.schema import BatchInput, MetricOutput, open_bundle

ROOT = Path(__file__).resolve().parents[2]


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(5, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.3)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.drop(self.bn(torch.relu(self.fc(x)))))


def _eval(model, batch):
    pred = model(batch["x"])
    return {"loss": torch.nn.functional.mse_loss(pred, batch["y"]), "pred": pred}


def _recipe() -> Recipe:
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True, foreach=False)
    full = regression_batch(32)
    short = {k: v[:17] for k, v in full.items()}
    return Recipe(
        model=model,
        optimizer=opt,
        step=mse_step,
        example_batch=full,
        example_batches=[short],
        eval_step=_eval,
        entries={"predict": lambda model, batch: {"pred": model(batch["x"])}},
        seed=99,
        # Compared with torch_xla eager below, whose BatchNorm updates running_var with the
        # biased variance; numerics="pytorch" (the unbiased one) is checked against the CPU
        # in tests/equivalence.
        numerics="torch_xla",
    )


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("entries") / "net.stepbundle"
    export(_recipe(), path, mlir_dir=path.parent / "mlir")
    return path


def test_entries_and_buckets_in_the_manifest(bundle: Path) -> None:
    with open_bundle(bundle) as b:
        m = b.manifest
    assert set(m.entries) == {"train", "eval", "predict"}
    assert m.entries["train"].updates_state
    assert not m.entries["eval"].updates_state
    for entry in m.entries.values():
        sizes = [p.batch[0].spec.shape[0] for p in entry.programs]
        assert sizes == [32, 17]
    for name in ("eval", "predict"):
        for p in m.entries[name].programs:
            assert all(isinstance(o, MetricOutput) for o in p.outputs)
            assert all(i.kind.value != "rng_seed" for i in p.inputs)  # eval: no dropout
    # "predict" never reads y: the unused batch input is pruned from the program but
    # stays in its batch signature, so callers pass the same batch to every entry.
    pred = m.entries["predict"].programs[0]
    assert [b.name for b in pred.batch] == ["x", "y"]
    assert [i.name for i in pred.inputs if isinstance(i, BatchInput)] == ["x"]


def test_shape_buckets_match_torch_xla(bundle: Path) -> None:
    recipe = _recipe()
    full = make_batches(recipe, 2)
    short = [{k: v[:17] for k, v in b.items()} for b in full]
    batches = [full[0], short[0], full[1], short[1]]
    ref = train_eager_xla(_recipe, batches, 4, seed=99)
    t = load(bundle, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    losses = [float(t.step(b)["loss"]) for b in batches]
    assert np.allclose(losses, ref.series("loss"), rtol=1e-5, atol=0)
    state = t.state_dict()
    assert not any(k.endswith(".grad") for k in state)  # zero_grad() first: not kept
    for k, v in ref.state.items():
        if k.endswith(".grad"):
            continue
        got = state[k]
        assert np.max(np.abs(got - v)) <= 1e-5 * max(np.max(np.abs(v)), 1e-6), k


def test_eval_entry_matches_torch_xla_eval(bundle: Path) -> None:
    import torch_xla

    recipe = _recipe()
    batch = make_batches(recipe, 2)[1]
    t = load(bundle, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    got = t.evaluate(batch)
    dev = torch_xla.device()
    from stepbundle.exporter.workspace import move_to_device

    move_to_device(recipe.model, recipe.optimizer, dev)
    recipe.model.eval()
    with torch.no_grad():
        ref = _eval(recipe.model, {k: torch.from_numpy(v).to(dev) for k, v in batch.items()})
    np.testing.assert_allclose(np.asarray(got["pred"]), to_numpy(ref["pred"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(got["loss"]), float(ref["loss"].cpu()), rtol=1e-5)
    short = {k: v[:17] for k, v in batch.items()}
    assert np.asarray(t.evaluate(short, entry="predict")["pred"]).shape == (17, 3)


def test_program_format_and_mlir_text(bundle: Path) -> None:
    from stepbundle.stablehlo import artifact as mlir

    with open_bundle(bundle) as b:
        for entry in b.manifest.entries.values():
            for p in entry.programs:
                assert p.stablehlo_version in mlir.TARGET_CANDIDATES
                module = mlir.parse_artifact(b.section(p.section))
                assert len(module.signature().inputs) == len(p.inputs)
    texts = sorted(x.name for x in (bundle.parent / "mlir").iterdir())
    assert texts == sorted(
        f"net.stepbundle.{e}.{i}.mlir" for e in ("train", "eval", "predict") for i in (0, 1)
    )
    assert "func.func @main" in (bundle.parent / "mlir" / "net.stepbundle.train.0.mlir").read_text()


def test_export_is_deterministic(tmp_path: Path) -> None:
    export(_recipe(), tmp_path / "a.stepbundle")
    export(_recipe(), tmp_path / "b.stepbundle")
    assert (tmp_path / "a.stepbundle").read_bytes() == (tmp_path / "b.stepbundle").read_bytes()


def test_reserved_entry_name_is_refused() -> None:
    r = _recipe()
    r.entries = {"train": _eval}
    with pytest.raises(ExportError, match='may not be called "train"'):
        export(r, "/nonexistent/x.stepbundle")


def test_eval_step_that_changes_state_is_refused() -> None:
    def bad_eval(model, batch):
        model.train()  # BatchNorm would update its running statistics
        return {"pred": model(batch["x"])}

    r = _recipe()
    r.eval_step = bad_eval
    with pytest.raises(
        ExportError, match=r"The eval step \(shape bucket 0\) changed state \(bn\.running_mean"
    ):
        export(r, "/nonexistent/x.stepbundle")


# ------------------------------------------------------------ variants
class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 32)
        self.b = torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


def _variant(step):
    def recipe() -> Recipe:
        torch.manual_seed(0)
        model = _Mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True, foreach=False)
        return Recipe(model=model, optimizer=opt, step=step, example_batch=regression_batch(16))

    return recipe


def _clip_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optimizer.step()
    return {"loss": loss, "grad_norm": norm}


def _accumulate_step(model, optimizer, batch, k: int = 4):
    optimizer.zero_grad()
    total = 0.0
    for x, y in zip(batch["x"].chunk(k), batch["y"].chunk(k)):
        loss = torch.nn.functional.mse_loss(model(x), y) / k
        loss.backward()
        total = total + loss.detach()
    optimizer.step()
    return {"loss": total}


def _bf16_step(model, optimizer, batch):
    optimizer.zero_grad()
    with torch.autocast("xla", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss.float()}


def test_clip_grad_norm(tmp_path: Path) -> None:
    check_equivalent(_variant(_clip_step), tmp_path, steps=3)


def test_gradient_accumulation_over_micro_batches(tmp_path: Path) -> None:
    check_equivalent(_variant(_accumulate_step), tmp_path, steps=3)


def test_bf16_autocast(tmp_path: Path) -> None:
    # Same graph, same bf16 rounding on both sides: the fp32 tolerance still holds.
    check_equivalent(_variant(_bf16_step), tmp_path, steps=3)


# ------------------------------------------------------------ CLI
def _export_example(python: str, out: Path) -> subprocess.CompletedProcess[str]:
    """`stepbundle export` of the linear example, run with ``python``."""
    recipe = str(ROOT / "examples" / "linear_adamw.py") + ":recipe"
    return subprocess.run(
        [python, "-m", "stepbundle", "export", recipe, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_export_reports_stages_counts_and_size(tmp_path: Path) -> None:
    out = _export_example(sys.executable, tmp_path / "l.stepbundle")
    assert out.returncode == 0, out.stderr
    assert "[export] prepared:" in out.stderr and "[export] traced:" in out.stderr
    assert "train inputs: 2 batch, 6 constant, 6 optimizer_state, 2 parameter" in out.stderr
    assert "stages: " in out.stderr
    path, size, digest = out.stdout.strip().split("\t")
    assert int(size.split()[0]) == os.path.getsize(path)
    assert digest.startswith("sha256:")


def test_cli_export_refusal_is_a_clean_error(tmp_path: Path) -> None:
    recipe_file = tmp_path / "bad.py"
    recipe_file.write_text(
        "import torch\n"
        "from stepbundle.exporter import Recipe\n"
        "def step(m, o, b):\n"
        "    o.zero_grad(); loss = m(b['x']).sum(); loss.backward(); o.step(); return {'loss': loss.item()}\n"
        "def recipe():\n"
        "    m = torch.nn.Linear(3, 1)\n"
        "    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), step=step, example_batch={'x': torch.ones(2, 3)})\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepbundle",
            "export",
            f"{recipe_file}:recipe",
            "-o",
            str(tmp_path / "x.stepbundle"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1
    assert "stepbundle: error: The training step read a device value on the host" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "x.stepbundle").exists()


def test_export_in_the_lean_environment_asks_for_the_extra(
    lean_python: str, tmp_path: Path
) -> None:
    out = _export_example(lean_python, tmp_path / "x")
    assert out.returncode == 2
    assert "Exporting needs torch: install a front-end" in out.stderr
    assert "pip install 'stepbundle[export-torch]'" in out.stderr
    assert "'stepbundle[export]' (torch 2.9 + torch_xla)" in out.stderr


# ------------------------------------------------------------ back into PyTorch
def test_checkpoint_loads_back_into_the_module_and_optimizer(tmp_path: Path) -> None:
    from stepbundle.exporter.checkpoint import load_into

    recipe_fn = _variant(_clip_step)
    path = tmp_path / "v.stepbundle"
    export(recipe_fn(), path)
    batches = make_batches(recipe_fn(), 4)
    t = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    t.run(batches, 3)
    ckpt = tmp_path / "c.safetensors"
    t.save_checkpoint(ckpt)
    # Continue 1 more step in the runtime ...
    after_runtime = float(t.step(batches[3])["loss"])
    # ... and, separately, in PyTorch (torch_xla) from the checkpoint.
    import torch_xla

    from stepbundle.exporter.workspace import move_to_device

    r = recipe_fn()
    move_to_device(r.model, r.optimizer, torch_xla.device())
    meta = load_into(r.model, r.optimizer, ckpt)
    assert meta.step == 3
    sd = t.state_dict()
    assert float(r.optimizer.state[r.model.a.weight]["step"].cpu()) == 3.0
    torch_xla.sync()
    out = r.step(
        r.model,
        r.optimizer,
        {k: torch.from_numpy(v).to(torch_xla.device()) for k, v in batches[3].items()},
    )
    torch_xla.sync()
    assert float(out["loss"].cpu()) == pytest.approx(after_runtime, rel=1e-5)
    for k in ("a.weight", "b.bias"):
        assert np.allclose(to_numpy(r.model.state_dict()[k]), sd[k], rtol=1e-5, atol=1e-6)


def test_in_process_and_lean_runtimes_agree(tmp_path: Path, lean_python: str) -> None:
    from support import run_bundle_lean

    recipe_fn = _variant(_accumulate_step)
    path = tmp_path / "acc.stepbundle"
    export(recipe_fn(), path)
    batches = make_batches(recipe_fn(), 3)
    a = run_bundle_inprocess(path, batches, 3)
    b = run_bundle_lean(lean_python, path, batches, 3, tmp_path)
    np.testing.assert_allclose(a.series("loss"), b.series("loss"), rtol=1e-5)
