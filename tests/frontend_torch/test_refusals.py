"""Steps a bundle could not replay faithfully are refused, with the value and the fix; the
user's objects are left exactly as they were, refused or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import linear_adamw
import pytest
import torch
import torch.nn.functional as F

from stepbundle.export_torch import ExportError, export

_EXPORTED: dict[str, Any] = {}


def _recipe(step: Any = None, **kw: Any) -> Any:
    r = linear_adamw.recipe()
    if step is not None:
        r.step = step
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def _loss(model: Any, batch: Any) -> Any:
    return F.mse_loss(model(batch["x"]), batch["y"])


def _refusal(recipe: Any, tmp_path: Path) -> str:
    path = tmp_path / "refused.stepbundle"
    with pytest.raises(ExportError) as info:
        export(recipe, path)
    assert not path.exists(), "a refused export must write nothing"
    return str(info.value)


def test_a_python_decision_on_a_tensor_is_refused(tmp_path: Path) -> None:
    def step(model: Any, opt: Any, batch: Any) -> Any:
        opt.zero_grad()
        loss = _loss(model, batch)
        if loss > 1.0:  # decided on the host, once, at trace time
            loss = loss * 2
        loss.backward()
        opt.step()
        return {"loss": loss}

    msg = _refusal(_recipe(step), tmp_path)
    assert "Python decision on a tensor's value" in msg and "torch.where" in msg


def test_a_data_dependent_shape_is_refused(tmp_path: Path) -> None:
    def step(model: Any, opt: Any, batch: Any) -> Any:
        opt.zero_grad()
        out = model(batch["x"])
        loss = out[out > 0].sum()  # boolean masking: the shape depends on the data
        loss.backward()
        opt.step()
        return {"loss": loss}

    msg = _refusal(_recipe(step), tmp_path)
    assert "output shape depends on the values" in msg


def test_a_learning_rate_changed_inside_the_step_is_named(tmp_path: Path) -> None:
    r = _recipe()
    sched = torch.optim.lr_scheduler.StepLR(r.optimizer, step_size=1, gamma=0.5)
    inner = r.step

    def step(model: Any, opt: Any, batch: Any) -> Any:
        out = inner(model, opt, batch)
        sched.step()
        return out

    r.step = step
    msg = _refusal(r, tmp_path)
    assert "changed between two consecutive traced steps" in msg
    assert "param_groups[0]['lr'] changed from" in msg
    assert "hyperparameters=('lr',)" in msg


def test_a_declared_hyperparameter_changed_by_the_step_is_refused(tmp_path: Path) -> None:
    inner = linear_adamw.train_step

    def step(model: Any, opt: Any, batch: Any) -> Any:
        out = inner(model, opt, batch)
        opt.param_groups[0]["lr"] = 0.01
        return out

    msg = _refusal(_recipe(step, hyperparameters=("lr",)), tmp_path)
    assert "changed hyperparameter 'lr' itself" in msg


def test_an_undeclared_hyperparameter_key_is_refused(tmp_path: Path) -> None:
    msg = _refusal(_recipe(hyperparameters=("learning_rate",)), tmp_path)
    assert "'learning_rate' is not a key" in msg and "hyperparameters=('lr',)" in msg


def test_a_write_to_a_tensor_outside_the_state_is_refused(tmp_path: Path) -> None:
    counter = torch.zeros(())
    inner = linear_adamw.train_step

    def step(model: Any, opt: Any, batch: Any) -> Any:
        out = inner(model, opt, batch)
        counter.add_(1)  # a tensor the bundle does not know, updated every step
        return out

    msg = _refusal(_recipe(step), tmp_path)
    assert "not part of the training state" in msg and "register_buffer" in msg


class _LazyMomentum(torch.optim.Optimizer):
    """An optimizer the front-ends' table does not know (torch.optim's are all in it, #39
    item 4): it creates its state in its first step."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.01})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if "buf" not in st:
                    st["buf"] = torch.zeros_like(p)
                st["buf"].mul_(0.9).add_(p.grad)
                p.add_(st["buf"], alpha=-group["lr"])


def test_optimizer_state_created_by_the_first_step_is_refused(tmp_path: Path) -> None:
    r = _recipe()
    r.optimizer = _LazyMomentum(r.model.parameters())
    msg = _refusal(r, tmp_path)
    assert "created new optimizer state" in msg and "take one optimizer step" in msg


def test_metrics_must_be_tensors_and_include_the_loss(tmp_path: Path) -> None:
    def item(model: Any, opt: Any, batch: Any) -> Any:
        return {"loss": 1.0}

    assert "metrics must be tensors" in _refusal(_recipe(item), tmp_path)

    def no_loss(model: Any, opt: Any, batch: Any) -> Any:
        return {"error": _loss(model, batch)}

    assert 'must return "loss"' in _refusal(_recipe(no_loss), tmp_path)


def test_an_eval_entry_that_changes_state_is_refused(tmp_path: Path) -> None:
    def bad_eval(model: Any, batch: Any) -> Any:
        with torch.no_grad():
            model.weight.mul_(0.5)
        return {"loss": _loss(model, batch)}

    msg = _refusal(_recipe(eval_step=bad_eval), tmp_path)
    assert "eval step changed state (weight)" in msg


def test_an_operator_without_lowering_is_refused_with_the_way_out(tmp_path: Path) -> None:
    def step(model: Any, opt: Any, batch: Any) -> Any:
        opt.zero_grad()
        loss = torch.linalg.qr(model(batch["x"]))[1].abs().sum()
        loss.backward()
        opt.step()
        return {"loss": loss}

    msg = _refusal(_recipe(step), tmp_path)
    assert "cannot lower to StableHLO" in msg and "--frontend torch_xla" in msg


def _snapshot(r: Any) -> dict[str, Any]:
    return {
        "params": {n: (p, p.detach().clone(), p.grad) for n, p in r.model.named_parameters()},
        "buffers": {n: (b, b.clone()) for n, b in r.model.named_buffers()},
        "groups": [dict(g) for g in r.optimizer.param_groups],
        "state": r.optimizer.state,
        "state_values": {
            id(p): {k: v.clone() for k, v in s.items()} for p, s in r.optimizer.state.items()
        },
        "training": [m.training for m in r.model.modules()],
        "rng": torch.random.get_rng_state(),
    }


def _assert_same(before: dict[str, Any], r: Any) -> None:
    after = _snapshot(r)
    for n, (p, v, grad) in before["params"].items():
        q, w, grad2 = after["params"][n]
        assert q is p and torch.equal(v, w) and grad2 is grad, n
    for n, (b, v) in before["buffers"].items():
        assert after["buffers"][n][0] is b and torch.equal(v, after["buffers"][n][1]), n
    for g0, g1 in zip(before["groups"], after["groups"]):
        assert g0.keys() == g1.keys() and all(g0[k] is g1[k] for k in g0)
    assert after["state"] is before["state"]
    for pid, st in before["state_values"].items():
        assert all(torch.equal(v, after["state_values"][pid][k]) for k, v in st.items())
    assert after["training"] == before["training"]
    assert torch.equal(after["rng"], before["rng"])


def test_the_users_objects_are_untouched_by_an_export(tmp_path: Path) -> None:
    r = _recipe(hyperparameters=("lr",))
    for g in r.optimizer.param_groups:  # eager torch refuses capturable=True on the CPU
        g["capturable"] = False
    r.step(r.model, r.optimizer, dict(r.example_batch))  # real state and gradients
    r.model.eval()
    before = _snapshot(r)
    export(r, tmp_path / "ok.stepbundle")
    _assert_same(before, r)


def test_the_users_objects_are_untouched_by_a_refused_export(tmp_path: Path) -> None:
    def step(model: Any, opt: Any, batch: Any) -> Any:
        out = linear_adamw.train_step(model, opt, batch)
        if out["loss"] > 0:
            pass
        return out

    r = _recipe(step)
    before = _snapshot(r)
    _refusal(r, tmp_path)
    _assert_same(before, r)


def test_torch_xla_numerics_is_refused_and_pytorch_recorded(tmp_path: Path) -> None:
    """The torch front-end has no torch_xla BatchNorm ops to keep: numerics="torch_xla" is
    refused, and what it writes computes BatchNorm from torch's decompositions (two passes,
    no batch_norm_training / batch_norm_grad ops), recorded as "pytorch"."""
    import torch_cases

    from stepbundle.schema import open_bundle

    msg = _refusal(_recipe(numerics="torch_xla"), tmp_path)
    assert "Recipe.numerics is 'torch_xla'" in msg and "stepbundle.exporter.export" in msg
    path = tmp_path / "mlp.stepbundle"
    export(torch_cases.mlp(), path, mlir_dir=tmp_path)
    with open_bundle(path) as b:
        assert b.manifest.numerics == "pytorch"
    text = (tmp_path / "mlp.stepbundle.train.0.mlir").read_text()
    assert "batch_norm" not in text
    assert text.count("stablehlo.reduce") >= 2  # the statistics, as plain reductions


@pytest.mark.parametrize(
    ("torch_setting", "recorded"), [("highest", "highest"), ("medium", "default")]
)
def test_torch_matmul_precision_is_recorded(
    tmp_path: Path, torch_setting: str, recorded: str
) -> None:
    """torch.get_float32_matmul_precision() at export, as StableHLO's precision names."""
    import torch_cases

    from stepbundle.schema import open_bundle

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(torch_setting)
    try:
        path = tmp_path / "mlp.stepbundle"
        export(torch_cases.mlp(), path)
    finally:
        torch.set_float32_matmul_precision(before)
    with open_bundle(path) as b:
        assert b.manifest.matmul_precision == recorded


@pytest.mark.parametrize(("eval_entry", "recorded"), [(False, "default"), (True, "highest")])
def test_a_bf16_autocast_step_records_the_default_precision(
    tmp_path: Path, eval_entry: bool, recorded: str
) -> None:
    """torch's float32 matmul precision governs float32 products only. Under bf16
    autocast every product of the training step takes bf16 operands, so the bundle
    records "default" (docs/tpu.md); an eval entry outside autocast has float32
    products, and torch's "highest" is recorded as before."""
    import dataclasses

    import torch_cases

    from stepbundle.schema import open_bundle

    def step(model: Any, optimizer: Any, batch: dict[str, Any]) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch_cases.mlp_step(model, optimizer, batch)

    base = torch_cases.mlp()
    recipe = dataclasses.replace(base, step=step, eval_step=base.eval_step if eval_entry else None)
    assert torch.get_float32_matmul_precision() == "highest"  # torch's default
    lines: list[str] = []
    path = tmp_path / "mlp.stepbundle"
    export(recipe, path, progress=lines.append)
    with open_bundle(path) as b:
        assert b.manifest.matmul_precision == recorded
    said = [line for line in lines if line.startswith("matmul precision: default")]
    assert len(said) == (recorded == "default")


def test_a_float32_outer_product_is_no_float32_product(tmp_path: Path) -> None:
    """Hugging Face's Llama computes its rotary angles as a float32 product with autocast
    off, an outer product (``inv_freq @ positions``): lowered as a multiplication, which
    no precision rounds, it leaves the bf16 step recording "default"."""
    import dataclasses

    import torch_cases

    from stepbundle.schema import open_bundle

    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))

    def step(model: Any, optimizer: Any, batch: dict[str, Any]) -> Any:
        with torch.autocast("cpu", enabled=False):
            angles = inv[None, :, None].float() @ torch.arange(3.0)[None, None, :]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch_cases.mlp_step(model, optimizer, batch)
        return {**out, "angle": angles.cos().sum()}

    recipe = dataclasses.replace(torch_cases.mlp(), step=step, eval_step=None)
    path = tmp_path / "mlp.stepbundle"
    export(recipe, path)
    with open_bundle(path) as b:
        assert b.manifest.matmul_precision == "default"


def test_the_products_the_precision_looks_at_are_lowered() -> None:
    """``export._PRODUCTS`` names the operators lowered to matrix products; each is one the
    front-end lowers (a renamed operator would silently count as no product)."""
    import importlib

    from stepbundle.export_torch.registry import LOWERINGS

    export_module = importlib.import_module("stepbundle.export_torch.export")
    assert export_module._PRODUCTS
    assert all(op in LOWERINGS for op in export_module._PRODUCTS)
