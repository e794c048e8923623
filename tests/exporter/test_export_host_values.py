"""The torch_xla front-end reads the bundle's initial state on the host, never copying the
device state back (issue #40: the copies of the optimizer moments and gradients were 12
bytes per parameter with AdamW).

``Workspace.host_value`` gives, for each device tensor the workspace made, the user's own
CPU tensor it copied, or for the state it made (a fresh optimizer's, zero gradients) one
element expanded to the tensor's shape. Checked here against the device tensors
themselves, bit for bit, for every optimizer rule the workspace has; and the writer's
input (``_initial_values``) is checked to be those tensors, not copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from stepbundle.exporter import Recipe
from stepbundle.exporter.export import _initial_values
from stepbundle.exporter.workspace import Workspace, xla_device
from stepbundle.schema import StateKind

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 3)
        self.bn = torch.nn.BatchNorm1d(3)  # float and int64 buffers
        self.register_buffer("positions", torch.arange(3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) + self.positions


def _optimizers() -> dict[str, Callable[[Any], torch.optim.Optimizer]]:
    import torch_xla.amp.syncfree as sf

    o = torch.optim
    return {
        "adamw": lambda p: o.AdamW(p, lr=0.01, capturable=True, foreach=False),
        "adam_host_step_amsgrad": lambda p: o.Adam(p, lr=0.01, amsgrad=True, foreach=False),
        "sgd_momentum": lambda p: o.SGD(p, lr=0.1, momentum=0.9),
        "rmsprop_centered": lambda p: o.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
        "rprop": lambda p: o.Rprop(p, lr=0.03, foreach=False),
        "asgd": lambda p: o.ASGD(p, lr=0.02, foreach=False),
        "adafactor": lambda p: o.Adafactor(p, lr=0.01),
        "syncfree_adam": lambda p: sf.Adam(p, lr=0.01),
        "syncfree_sgd": lambda p: sf.SGD(p, lr=0.1, momentum=0.9),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(_BITS[t.element_size()]) if t.numel() else t


def _recipe(kind: str, *, stepped: bool = False) -> Recipe:
    torch.manual_seed(0)
    model = _Net()
    if kind == "adamw_on_cpu":  # steps on the CPU (capturable=True would refuse the CPU)
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    else:
        opt = _optimizers()[kind](model.parameters())
    batch = {"x": torch.randn(4, 5)}
    if stepped:  # the user's own optimizer state and gradients, with differing elements
        model(batch["x"]).square().mean().backward()
        opt.step()
    return Recipe(model, opt, lambda m, o, b: {}, batch)


@pytest.mark.parametrize("kind", sorted(_optimizers()))
def test_host_values_are_the_device_state_bit_for_bit(kind: str) -> None:
    recipe = _recipe(kind)
    with Workspace(recipe, xla_device()) as ws:
        tensors = ws.state_tensors()
        made = 0
        for s in tensors:
            host = ws.host_value(s.tensor)
            if s.tensor.device.type == "cpu":  # a non-capturable Adam's step count
                assert host is None, s.name
                continue
            assert host is not None and host.device.type == "cpu", s.name
            assert (host.dtype, host.shape) == (s.tensor.dtype, s.tensor.shape), s.name
            assert torch.equal(_bits(host), _bits(s.tensor)), s.name
            if s.kind in (StateKind.OPTIMIZER_STATE, StateKind.GRADIENT) and host.numel() > 1:
                assert all(st == 0 for st in host.stride()), s.name  # made: one element
                made += 1
        assert made >= 2  # the zero gradients at least


def test_a_stepped_optimizer_and_its_gradients_are_the_users_own_tensors() -> None:
    recipe = _recipe("adamw_on_cpu", stepped=True)
    opt, model = recipe.optimizer, recipe.model
    user = {f"optimizer.state.{n}.{k}": v for n, p in model.named_parameters()
            for k, v in opt.state[p].items()}  # fmt: skip
    user |= {f"{n}.grad": p.grad for n, p in model.named_parameters()}
    with Workspace(recipe, xla_device()) as ws:
        for s in ws.state_tensors():
            if s.name in user:
                host = ws.host_value(s.tensor)
                assert host is not None and host.data_ptr() == user[s.name].data_ptr(), s.name
                assert torch.equal(host, s.tensor.cpu()), s.name


@pytest.mark.parametrize("include_state", [True, False])
def test_the_writer_gets_no_copy_of_the_state(include_state: bool) -> None:
    recipe = _recipe("adamw")
    recipe.include_state = include_state
    params = dict(recipe.model.named_parameters())
    with Workspace(recipe, xla_device()) as ws:
        values = _initial_values(recipe, ws.state_tensors(), ws)
    for name, p in params.items():
        v = values[name]
        if include_state:  # the user's own parameter, which nothing writes
            assert v.data_ptr() == p.data_ptr(), name
        else:  # not stored: its shape only
            assert v.is_meta, name
        for made in (f"optimizer.state.{name}.exp_avg", f"{name}.grad"):
            m = values[made]
            assert m.shape == p.shape and all(st == 0 for st in m.stride()), made
            assert not bool(m.reshape(-1)[0]), made
    assert torch.equal(values["positions"], torch.arange(3.0))
