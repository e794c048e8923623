"""The running variance under numerics="pytorch", for every kind of momentum.

torch_xla writes the running-variance update as ``var * m + running_var * (1 - m)``, but
folds ``m = 1`` into ``add(var, running_var * 0)``: the rewrite to PyTorch's unbiased
update (stablehlo/batch_norm.py) once missed that form. The oracle is PyTorch's own
BatchNorm in float64 on the CPU, one training step on the same batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import stepbundle.runtime as sr
from stepbundle.exporter import Recipe, export
from stepbundle.exporter.host_reads import HostReadError
from stepbundle.runtime import CompileOptions, LoadOptions


class _Net(torch.nn.Module):
    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 1)
        self.bn = torch.nn.BatchNorm2d(4, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


def _step(model, optimizer, batch):  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    loss = model(batch["x"]).pow(2).mean()
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 2, 2, generator=g) * 3 + 1  # n = 8 per channel: n/(n-1) = 8/7


def _export(momentum: float | None, path: Path) -> None:
    torch.manual_seed(0)
    net = _Net(momentum)
    export(
        Recipe(
            model=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.0),
            step=_step,
            example_batch={"x": _batch()},
        ),
        path,
    )


@pytest.mark.parametrize("momentum", [1.0, 0.5, 0.1])
def test_running_var_is_pytorchs_unbiased_update(tmp_path: Path, momentum: float) -> None:
    x = _batch()
    path = tmp_path / "bn.stepbundle"
    _export(momentum, path)
    trainer = sr.load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    trainer.step({"x": x.numpy()})
    got = trainer.state_dict()["bn.running_var"]

    torch.manual_seed(0)
    ref = _Net(momentum).double()
    ref.train()
    ref(x.double())
    want = ref.bn.running_var.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_a_cumulative_average_is_refused_as_a_host_read(tmp_path: Path) -> None:
    """momentum=None divides by num_batches_tracked as a Python float in torch's BatchNorm:
    a host read, refused (a bundle would freeze the first step's factor)."""
    with pytest.raises(HostReadError, match="Tensor.__float__"):
        _export(None, tmp_path / "bn.stepbundle")
    assert not (tmp_path / "bn.stepbundle").exists()
