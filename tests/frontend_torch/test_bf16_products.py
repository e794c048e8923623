"""The TPU-only rewrite of bf16 products written float32-out (stablehlo/bf16_products.py).

The torch front-end writes a bf16 x bf16 product as PyTorch's CPU computes it: float32
out, then rounded to bf16. On a TPU the runtime writes it bf16-out (the same values on
the matrix unit, and XLA can then fold the relayouts around it). Pinned here on a torch
front-end bundle's program: the rewrite takes exactly the products rounded by their one
use, leaves an ``nn.Linear``'s product with its bias (added in float32 before the one
rounding) and float32 products as written, and is off for the CPU, so a bundle's CPU
numbers do not move.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.export_torch import Recipe, export
from stepbundle.runtime.compile import rewrites
from stepbundle.runtime.placement.sharding import Placement
from stepbundle.schema import open_bundle
from stepbundle.schema.manifest import Program
from stepbundle.stablehlo.artifact import Module, parse_artifact
from stepbundle.stablehlo.graph import element_type, uses_of

WIDTH, VOCAB, TOKENS = 32, 16, 8


class _Net(nn.Module):
    """A Linear with a bias, one without, and a float32 product outside autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)
        self.mix = nn.Parameter(torch.eye(WIDTH) + 0.01)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.down(F.gelu(self.up(self.emb(idx))))
        return h.float() @ self.mix  # float32 x float32, autocast off


def _step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    optimizer.zero_grad()
    out = model(batch["idx"])
    loss = F.cross_entropy(out[:, :VOCAB], batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> tuple[Module, Program]:
    """The train program of ``_Net``'s bundle (torch front-end, SGD) and its record
    (the export check is off: only the program's text is read here)."""
    torch.manual_seed(0)
    model = _Net()
    rng = np.random.default_rng(0)
    batch = {k: torch.from_numpy(rng.integers(0, VOCAB, TOKENS)) for k in ("idx", "y")}
    path = tmp_path_factory.mktemp("bf16") / "net.stepbundle"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    export(
        Recipe(model=model, optimizer=opt, step=_step, example_batch=batch, seed=0),
        path,
        check=False,
    )
    with open_bundle(path) as b:
        record = b.manifest.entries["train"].programs[0]
        return parse_artifact(bytes(b.section(record.section))), record


def _products(module: Module) -> collections.Counter[str]:
    """Each product of ``module`` as 'operand types -> result type', counted, with what
    uses its float32 result where it is one of bf16 operands."""
    found: collections.Counter[str] = collections.Counter()
    with module._ctx:
        for op in module._operations():
            if op.name != "stablehlo.dot_general":
                continue
            a, b, out = (element_type(v) for v in (*op.operands, op.result))
            use = ""
            if (a, b, out) == ("bf16", "bf16", "f32"):
                use = " then " + "/".join(sorted(u.name for u in uses_of(op.result)))
            found[f"{a} x {b} -> {out}{use}"] += 1
    return found


def _rewrite(
    program: tuple[Module, Program], platform: str
) -> tuple[rewrites.Stage, rewrites.Stage, dict[str, int]]:
    module, record = program
    ctx = rewrites.RewriteContext(platform=platform, placement=Placement(jax.devices("cpu")[:1]))
    stage = rewrites.Stage(Module.parse_text(module, module.text()), record)
    rewrite = dict(rewrites.REWRITES)["bf16-products"]  # the pipeline's own entry
    return stage, rewrite(stage, ctx), ctx.notes


def test_a_tpu_gets_the_products_rounded_by_their_one_use_as_bf16_out(
    program: tuple[Module, Program],
) -> None:
    text = program[0].text()
    before = _products(program[0])
    rounded = before["bf16 x bf16 -> f32 then stablehlo.convert"]
    biased = before["bf16 x bf16 -> f32 then stablehlo.add"]
    # the forward's bias-free product and the backward's input and weight gradients;
    # up's forward product with its bias; mix's float32 products
    # down's forward, each Linear's input and weight gradients; up's forward (with its
    # bias); mix's forward and its two gradients
    assert (rounded, biased, before["f32 x f32 -> f32"]) == (5, 1, 3), before
    _, after, notes = _rewrite(program, "tpu")
    assert notes["bf16_products"] == rounded
    got = _products(after.module)
    want = before.copy()
    del want["bf16 x bf16 -> f32 then stablehlo.convert"]
    want["bf16 x bf16 -> bf16"] += rounded
    assert got == want  # the bias form and the float32 products as written
    # the rounding went with them: each rewritten product's uses read it directly
    assert after.module.text().count("stablehlo.convert") == (
        text.count("stablehlo.convert") - rounded
    )


def test_the_cpu_keeps_the_program_as_written(program: tuple[Module, Program]) -> None:
    stage, after, notes = _rewrite(program, "cpu")
    assert after is stage and "bf16_products" not in notes
    assert after.module.text() == program[0].text()
