"""Optimization barriers around the output head's products (``CompileOptions.head_barriers``,
``stablehlo/head_barriers.py``) change no value: a small language model over a vocabulary of
16,384 (what makes a product a head's), exported through the torch front-end and trained on
the CPU with and without them, takes the same steps bit for bit, and PyTorch's own steps
(an oracle that shares no code with either program)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.export_torch import export
from stepbundle.frontend.recipe import Recipe
from stepbundle.runtime import CompileOptions, LoadOptions, load

VOCAB, WIDTH, BATCH, T, STEPS = 16384, 16, 2, 8, 3


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        x = x + torch.tanh(self.mlp(x))  # a residual stream
        return self.head(self.norm(x))


def _step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch["idx"]).reshape(-1, VOCAB), batch["y"].reshape(-1))
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [
        {k: rng.integers(0, VOCAB, (BATCH, T)).astype(np.int64) for k in ("idx", "y")}
        for _ in range(STEPS)
    ]


def test_barriers_change_no_value(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    eager = [
        _step(reference, ref_opt, {k: torch.from_numpy(v) for k, v in b.items()})["loss"].item()
        for b in batches
    ]
    path = tmp_path / "lm.stepbundle"
    example = {k: torch.from_numpy(v) for k, v in batches[0].items()}
    export(Recipe(model=model, optimizer=opt, step=_step, example_batch=example, seed=0), path)

    runs = {}
    for barriers in (False, True):
        options = LoadOptions(compile=CompileOptions(cache_dir=False, head_barriers=barriers))
        trainer = load(path, "cpu", options)
        notes = trainer.load_info.head_barriers
        if barriers:  # the logits' product, the weight gradient and the input gradient
            assert notes == {
                "train[0]": "train[0]: optimization barriers around 3 products of the output "
                "head (as asked)"
            }
        else:
            assert notes == {}
        losses = [float(np.asarray(trainer.step(b)["loss"])) for b in batches]
        runs[barriers] = (losses, {k: np.asarray(v) for k, v in trainer.state_dict().items()})
    (plain, plain_state), (held, held_state) = runs[False], runs[True]
    assert plain == held
    assert plain_state.keys() == held_state.keys()
    for name in plain_state:
        assert np.array_equal(plain_state[name], held_state[name]), name
    # and both are PyTorch's steps, to float32 rounding
    np.testing.assert_allclose(plain, eager, rtol=2e-5, atol=2e-5)


def test_run_says_where_it_put_barriers(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches()
    path = tmp_path / "lm.stepbundle"
    example = {k: torch.from_numpy(v) for k, v in batches[0].items()}
    export(Recipe(model=model, optimizer=opt, step=_step, example_batch=example, seed=0), path)
    data = tmp_path / "data.npz"
    np.savez(data, **{k: np.stack([b[k] for b in batches]) for k in ("idx", "y")})
    out = {}
    for flag in ("on", "off", "auto"):
        cmd = [sys.executable, "-m", "stepbundle", "run", str(path), "--data", str(data),
               "--steps", "3", "--no-cache", "--json", "--head-barriers", flag]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        notes = [ln for ln in done.stderr.splitlines() if ln.startswith("[run] output head:")]
        if flag == "on":
            assert notes == [
                "[run] output head: train[0]: optimization barriers around 3 products of the "
                "output head (as asked)"
            ]
        else:  # off, and auto on the CPU: nothing weighed
            assert notes == []
        out[flag] = [json.loads(ln)["loss"] for ln in done.stdout.splitlines() if '"loss"' in ln]
    assert len(out["on"]) == 3
    assert out["on"] == out["off"] == out["auto"]
