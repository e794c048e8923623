"""Activation checkpointing through the torch front-end (``frontend_torch/remat.py``).

``torch.utils.checkpoint`` of either kind (and Hugging Face's
``gradient_checkpointing_enable()``) exports as a recomputation XLA cannot merge back into
the forward: each segment's recomputation reads its inputs through an
``optimization_barrier`` that also holds a gradient of the backward pass, so it runs where
the backward needs it. That it saves memory is XLA's doing on the TPU (XLA's CPU backend
drops the barriers): ``benchmarks/device/activation_checkpointing.py`` compiles for a v5e
offline. Here: the program's form, the export check against eager PyTorch, and the
refusal of dropout inside a segment whose recomputation restores the RNG state.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from stepbundle.export_torch import export
from stepbundle.frontend import Recipe
from stepbundle.frontend.errors import ExportError
from stepbundle.schema import open_bundle
from stepbundle.stablehlo.artifact import parse_artifact


class Block(nn.Module):
    def __init__(self, drop: float) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(16, 32), nn.Linear(32, 16), nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.drop(torch.tanh(self.a(x))))


class Net(nn.Module):
    def __init__(self, drop: float = 0.0, **kind: Any) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList([Block(drop) for _ in range(3)])
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, **self.kind)
        return self.head(x)


def _step(model: Any, opt: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    opt.zero_grad()
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    return {"loss": loss}


def _recipe(model: nn.Module) -> Recipe:
    torch.manual_seed(1)
    batch = {"x": torch.randn(8, 16), "y": torch.randint(0, 4, (8,))}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Recipe(model=model, optimizer=opt, step=_step, example_batch=batch)


def _program(path: Path) -> str:
    bundle = open_bundle(path)
    program = bundle.manifest.entries["train"].programs[0]
    return str(parse_artifact(bundle.section(program.section)).text())


def _barriers(text: str) -> list[int]:
    """The operand count of each optimization_barrier in the program."""
    return [
        len(ops.split(","))
        for ops in re.findall(r"= stablehlo\.optimization_barrier ([^:]+) :", text)
    ]


@pytest.mark.parametrize("reentrant", [False, True])
def test_each_segment_is_recomputed_behind_a_barrier_that_waits_for_a_gradient(
    reentrant: bool, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    lines: list[str] = []
    report = export(
        _recipe(Net(use_reentrant=reentrant)), tmp_path / "net.stepbundle", check=True,
        progress=lines.append,
    )  # fmt: skip
    # The bundle's step is eager PyTorch's (the export check, on by default).
    assert report.check.ran and not report.check.reason, report.check
    # The export line counts the segments (it said nothing of them).
    captured = [line for line in lines if line.startswith("captured: ")]
    assert len(captured) == 1 and captured[0].endswith(
        "; 3 checkpointed segments a step, each recomputed in the backward (torch.utils.checkpoint)"
    ), captured
    text = _program(tmp_path / "net.stepbundle")
    # One barrier a segment, holding the segment's input and a gradient of the backward.
    assert _barriers(text) == [2, 2, 2], _barriers(text)
    # The recomputation is in the program: each block's tanh twice.
    assert text.count("stablehlo.tanh") == 6


def test_hugging_face_gradient_checkpointing_exports_recomputed(tmp_path: Path) -> None:
    """``gradient_checkpointing_enable()`` as its users call it (the reentrant kind by
    default), on a small GPT-2 with dropout 0."""
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable()
    model.train()

    def step(m: Any, opt: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        opt.zero_grad()
        loss = m(input_ids=batch["idx"], labels=batch["idx"]).loss
        loss.backward()
        opt.step()
        return {"loss": loss}

    batch = {"idx": torch.randint(0, 64, (2, 16))}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recipe = Recipe(model=model, optimizer=opt, step=step, example_batch=batch)
    report = export(recipe, tmp_path / "gpt2.stepbundle", check=True)
    assert report.check.ran and not report.check.reason, report.check
    barriers = _barriers(_program(tmp_path / "gpt2.stepbundle"))
    assert len(barriers) == 2 and min(barriers) >= 2, barriers


@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_inside_a_segment_that_restores_the_rng_is_refused(
    reentrant: bool, tmp_path: Path
) -> None:
    """Eager PyTorch's recomputation draws the forward's masks again; the program would
    draw new ones for the backward (a different gradient, the same loss)."""
    torch.manual_seed(0)
    with pytest.raises(ExportError, match="inside a segment of torch.utils.checkpoint"):
        export(_recipe(Net(0.2, use_reentrant=reentrant)), tmp_path / "d.stepbundle")


def test_dropout_inside_a_segment_that_draws_anew_exports(tmp_path: Path) -> None:
    """With preserve_rng_state=False eager PyTorch's recomputation draws new masks too:
    the program's own draws for it are that, and the check replays them."""
    torch.manual_seed(0)
    model = Net(0.2, use_reentrant=False, preserve_rng_state=False)
    report = export(_recipe(model), tmp_path / "d.stepbundle", check=True)
    assert report.check.ran and not report.check.reason, report.check
    assert _barriers(_program(tmp_path / "d.stepbundle")) == [2, 2, 2]


def test_a_reentrant_segment_without_an_input_that_requires_grad_is_refused(
    tmp_path: Path,
) -> None:
    """Eager PyTorch only warns, and the segment's parameters silently get no gradient;
    the torch_xla front-end refuses the same step (frontend_core/segments.py)."""

    class Gradless(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.head = Block(0.0), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=True))

    torch.manual_seed(0)
    with pytest.raises(ExportError, match=r"parameters \(a.weight, a.bias, b.weight, b.bias\)"):
        export(_recipe(Gradless()), tmp_path / "g.stepbundle")


def test_a_segment_whose_last_result_is_detached_still_waits_for_a_gradient(
    tmp_path: Path,
) -> None:
    """use_reentrant=False: the gradient the barrier waits for is that of the last result
    autograd differentiates, not of a detached metric the segment also returns (review:
    the barrier had held the input alone, which XLA may recompute with the forward)."""

    class Both(Block):
        def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
            h = super().forward(x)
            return h, h.detach().mean()

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.blocks, self.head = (
                nn.Linear(16, 16),
                nn.ModuleList([Both(0.0), Both(0.0)]),
                nn.Linear(16, 4),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for block in self.blocks:
                x, _ = checkpoint(block, x, use_reentrant=False)
            return self.head(x)

    torch.manual_seed(0)
    report = export(_recipe(Outer()), tmp_path / "b.stepbundle", check=True)
    assert report.check.ran and not report.check.reason, report.check
    assert _barriers(_program(tmp_path / "b.stepbundle")) == [2, 2]
