"""Set-up of the tests both front-ends must pass: each test runs once per front-end.

Both test environments collect this folder: ``.venv`` (torch 2.9 + torch_xla) runs the
torch_xla front-end's half, ``.venv-torch`` (torch 2.10+ without torch_xla) the torch
front-end's half; each skips the other half, saying why. ``frontend`` is the fixture a
test takes to be run for both.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest


def _has_torch_xla() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def _torch_front_end_runs() -> bool:
    """The torch front-end's environment: torch 2.10 or newer, and no torch_xla (the torch
    front-end's tests prove it works where torch_xla is absent)."""
    if _has_torch_xla() or importlib.util.find_spec("torch") is None:
        return False
    import torch

    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 10)


@dataclass(frozen=True)
class Frontend:
    """One front-end as the shared tests use it.

    Attributes:
      name: "torch_xla" or "torch".
      export: its ``export(recipe, path, ...)``.
      eager: the run a bundle must reproduce, ``support.train_eager_xla`` (torch_xla
        eager) or ``support.train_eager_cpu`` (PyTorch on the CPU).
      adam: keyword arguments an Adam/AdamW must be built with to be exported (torch_xla
        needs the step count on the device: capturable=True, foreach=False).
    """

    name: str
    export: Callable[..., Any]
    eager: Callable[..., Any]
    adam: dict[str, Any]


def _torch_xla() -> Frontend:
    from support import train_eager_xla

    from stepbundle.exporter import export

    return Frontend("torch_xla", export, train_eager_xla, {"capturable": True, "foreach": False})


def _torch() -> Frontend:
    from support import train_eager_cpu

    from stepbundle.export_torch import export

    return Frontend("torch", export, train_eager_cpu, {})


@pytest.fixture(
    params=[
        pytest.param(
            "torch_xla",
            marks=pytest.mark.skipif(
                not _has_torch_xla(),
                reason="the torch_xla front-end's half runs in the torch_xla environment (.venv)",
            ),
        ),
        pytest.param(
            "torch",
            marks=pytest.mark.skipif(
                not _torch_front_end_runs(),
                reason="the torch front-end's half runs in the torch environment (.venv-torch: "
                "torch 2.10+, no torch_xla)",
            ),
        ),
    ]
)
def frontend(request: pytest.FixtureRequest) -> Frontend:
    return _torch_xla() if request.param == "torch_xla" else _torch()
