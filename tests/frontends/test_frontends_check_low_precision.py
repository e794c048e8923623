"""The export check under low-precision bounds (issue #39 review, item 2): the bounds'
value term is bfloat16-sized (about 3% of a tensor's norm), more than one step moves a
weight, so the update itself is judged: an update further than half its size from eager's
goes to PyTorch float64, and is refused where it is far beyond eager's own distance from
float64's update. A dropped weight update under bf16 autocast, and under
numerics="torch_xla", is refused; faithful bundles pass, a convolution's bias before
BatchNorm (whose update is rounding noise, eager itself about its whole size off float64)
included.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import _has_torch_xla, _torch_front_end_runs
from test_frontends_export_check import _cnn, _dropping
from torch import nn

from stepbundle.frontend.recipe import Recipe
from stepbundle.frontend.step_check import CheckFailed, check_bundle
from stepbundle.frontend.step_compare import LOW_PRECISION, suspects, update_verdicts, verdicts
from stepbundle.schema import open_bundle


def test_a_dropped_update_is_suspect_and_float64_refuses_it() -> None:
    """The review's synthetic case: a 256x256 weight (std 0.05), one Adam update at lr
    1e-3 left out, passes the low-precision bound but not the update's judgment."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(256, 256, generator=g) * 0.05
    step = 1e-3 * torch.sign(torch.randn(256, 256, generator=g))  # Adam's first step
    eager = w0 + step
    f64 = eager.double() + 1e-4 * step.double()  # eager's update 1e-4 off float64's
    before = {"w": w0}
    found = verdicts([], ["w"], ({}, {"w": w0.clone()}), ({}, {"w": eager}), before, LOW_PRECISION)
    assert found[0].ratio < 1.0  # the value bound alone misses it
    assert suspects(found, LOW_PRECISION) == {"w"}
    judged = update_verdicts(
        {"w"}, {"w": w0.clone()}, {"w": eager}, {"w": f64}, before, LOW_PRECISION
    )
    assert judged["w"].ratio > 3.0, judged["w"]
    # An update of rounding noise: eager is as far from float64 as the bundle is.
    noise = 1e-3 * torch.sign(torch.randn(256, 256, generator=g))
    bundle = {"w": w0 + noise}
    found = verdicts([], ["w"], ({}, bundle), ({}, {"w": eager}), before, LOW_PRECISION)
    judged = update_verdicts({"w"}, bundle, {"w": eager}, {"w": w0.double()}, before, LOW_PRECISION)
    assert suspects(found, LOW_PRECISION) == {"w"} and judged["w"].ratio <= 1.0, judged["w"]


class _ConvBias(nn.Module):
    """A convolution with a bias before BatchNorm (its gradient is zero in exact
    arithmetic) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _autocast_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch["x"])
    loss = nn.functional.cross_entropy(out.float(), batch["y"])
    loss.backward()
    opt.step()
    return {"loss": loss}


def _autocast(seed: int) -> Recipe:
    torch.manual_seed(seed)
    model = _ConvBias()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"x": torch.randn(4, 3, 8, 8), "y": torch.randint(0, 7, (4,))}
    recipe = Recipe(model, opt, _autocast_step, batch)
    recipe.include_state = False  # one bundle for every seed: the weights come from the model
    return recipe


@pytest.fixture(scope="module")
def autocast_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The torch front-end's bundle (torch_xla traces on its own device, where
    autocast('cpu') does not apply), shared by the autocast tests."""
    if not _torch_front_end_runs():
        pytest.skip("the torch front-end's half runs in .venv-torch (torch 2.10+, no torch_xla)")
    from stepbundle.export_torch import export

    out = tmp_path_factory.mktemp("autocast") / "b.stepbundle"
    return Path(export(_autocast(0), out, check=False).path)


def test_faithful_autocast_bundles_pass(autocast_bundle: Path) -> None:
    with open_bundle(autocast_bundle) as b:
        manifest = b.manifest
    for seed in range(2):
        report = check_bundle(_autocast(seed), autocast_bundle, manifest, random_reference="none")
        assert report.ran, report
        assert "within eager's own distance from float64" in report.closest, report.closest


def test_the_suites_cnn_under_autocast_with_sgd_momentum_passes(autocast_bundle: Path) -> None:
    """The suite's CNN (a convolution's bias before BatchNorm) under autocast, SGD with
    nesterov momentum: the bias's momentum buffer, rounding noise, is beyond the bf16
    bound itself, and float64 passes it (it was refused before the update was judged)."""
    from stepbundle.export_torch import export

    recipe = _cnn({})
    recipe.step = _autocast_step
    report = export(recipe, autocast_bundle.parent / "sgd.stepbundle", check=True)
    assert report.check is not None and report.check.ran, report.check
    assert "within eager's own distance from float64" in report.check.closest


@pytest.mark.parametrize("state", ["conv.weight", "fc.weight"])
def test_a_dropped_update_is_refused_under_autocast(
    autocast_bundle: Path, state: str, tmp_path: Path
) -> None:
    bad = _dropping(autocast_bundle, tmp_path / "bad.stepbundle", state)
    with open_bundle(bad) as b:
        manifest = b.manifest
    with pytest.raises(CheckFailed) as caught:
        check_bundle(_autocast(0), bad, manifest, random_reference="none")
    e = caught.value
    assert e.name == state, str(e)
    assert "float64's update" in str(e) and "float32 rounding" not in str(e)
    assert "known to differ from eager" in str(e) and "to skip the check" not in str(e)
    assert math.isfinite(e.bundle_value) and e.bundle_value != e.eager_value


@pytest.fixture(scope="module")
def xla_numerics_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's CNN (SGD nesterov lr 0.05) exported by the torch_xla front-end with
    numerics="torch_xla", unchecked, shared by the tests below."""
    if not _has_torch_xla():
        pytest.skip("numerics='torch_xla' is the torch_xla front-end's: it runs in .venv")
    from stepbundle.exporter import export

    out = tmp_path_factory.mktemp("xla_numerics") / "good.stepbundle"
    return Path(export(_xla_numerics(), out, check=False).path)


def _xla_numerics() -> Recipe:
    recipe = _cnn({"capturable": True, "foreach": False})
    recipe.numerics = "torch_xla"
    return recipe


@pytest.mark.parametrize("state", ["0.weight", "8.weight"])
def test_a_dropped_update_is_refused_under_numerics_torch_xla(
    xla_numerics_bundle: Path, state: str, tmp_path: Path
) -> None:
    from stepbundle.exporter.check import references

    bad = _dropping(xla_numerics_bundle, tmp_path / "bad.stepbundle", state)
    with open_bundle(bad) as b:
        manifest = b.manifest
    plain, _ = references("torch_xla", 0)
    with pytest.raises(CheckFailed) as caught:
        check_bundle(_xla_numerics(), bad, manifest, reference=plain, random_reference="none")
    assert caught.value.name == state, str(caught.value)
    assert "float64's update" in str(caught.value)


def test_the_faithful_numerics_torch_xla_bundle_passes(xla_numerics_bundle: Path) -> None:
    from stepbundle.exporter.check import references

    with open_bundle(xla_numerics_bundle) as b:
        manifest = b.manifest
    plain, _ = references("torch_xla", 0)
    report = check_bundle(
        _xla_numerics(), xla_numerics_bundle, manifest, reference=plain, random_reference="none"
    )
    assert report.ran and report.reference == "torch_xla eager (numerics='torch_xla')", report
    print(report.line())
