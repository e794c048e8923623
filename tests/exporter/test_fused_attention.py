"""Traced attention swapped for fused kernels (stablehlo/attention.py), pinned on the CPU.

A TPU runs the swap for real; here the same rewrite runs with the splash-attention
kernels interpreted (Pallas's interpreter lowers them to ordinary XLA ops), so the whole
path — finding the attention in a bundle exported by torch_xla, lowering the kernels,
moving them into the program, rewiring the forward's output and the backward's three
gradients — is checked against PyTorch in float64 on the CPU, which shares no code with
either program.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from stepbundle.exporter import Recipe, export
from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.runtime.compile import rewrites
from stepbundle.runtime.dtypes import array_from_section
from stepbundle.schema.reader import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.attention import find_attention

VOCAB, T, WIDTH, HEADS, LAYERS, BATCH, LR = 64, 128, 128, 2, 2, 2, 0.5


class _Block(nn.Module):
    def __init__(self, causal: bool, divide: bool = False, buffer_mask: bool = False) -> None:
        super().__init__()
        self.causal, self.divide, self.buffer_mask = causal, divide, buffer_mask
        if buffer_mask:  # nanoGPT's way: a state buffer, which a checkpoint may change
            self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            a.view(b, t, HEADS, c // HEADS).transpose(1, 2) for a in self.qkv(x).split(c, dim=2)
        )
        if self.divide:  # nanoGPT's way
            att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // HEADS))
        if self.buffer_mask:
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        elif self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        return x + self.proj(y)


class _Net(nn.Module):
    def __init__(
        self, causal: bool = True, divide: bool = False, buffer_mask: bool = False
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([_Block(causal, divide, buffer_mask) for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    optimizer.zero_grad()
    with torch.autocast(batch["idx"].device.type, dtype=torch.bfloat16):
        logits = model(batch["idx"])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), batch["y"].reshape(-1))
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _eval(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    with torch.autocast(batch["idx"].device.type, dtype=torch.bfloat16):
        logits = model(batch["idx"])
    return {
        "loss": nn.functional.cross_entropy(
            logits.float().reshape(-1, VOCAB), batch["y"].reshape(-1)
        )
    }


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "idx": rng.integers(0, VOCAB, (BATCH, T)).astype(np.int64),
        "y": rng.integers(0, VOCAB, (BATCH, T)).astype(np.int64),
    }


_EXPORTS: dict[tuple[bool, bool, bool, int], tuple[Path, dict[str, np.ndarray]]] = {}


def _export(
    tmp_path: Path, causal: bool = True, divide: bool = False, buffer_mask: bool = False
) -> tuple[Path, dict[str, np.ndarray]]:
    """The model of these settings (seed 0, context ``T``) exported, and its initial state:
    once per session (most tests here and test_attention_state_masks.py read the same
    bundle; none changes it), in the ``tmp_path`` of the first test that asks."""
    key = (causal, divide, buffer_mask, T)
    if key not in _EXPORTS:
        _EXPORTS[key] = _export_now(tmp_path, causal, divide, buffer_mask)
    path, initial = _EXPORTS[key]
    return path, {k: v.copy() for k, v in initial.items()}


def _export_now(
    tmp_path: Path, causal: bool, divide: bool, buffer_mask: bool
) -> tuple[Path, dict[str, np.ndarray]]:
    torch.manual_seed(0)
    model = _Net(causal, divide, buffer_mask)
    initial = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    example = {k: torch.from_numpy(v) for k, v in _batch().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    path = tmp_path / f"attn-{int(causal)}{int(divide)}{int(buffer_mask)}-{T}.stepbundle"
    recipe = Recipe(
        model=model, optimizer=opt, step=_step, eval_step=_eval, example_batch=example, seed=0
    )
    export(recipe, path)
    return path, initial


def _float64_step(
    initial: dict[str, np.ndarray], causal: bool = True, divide: bool = False
) -> tuple[float, dict]:
    """The step in float64 without autocast: the loss and the parameters after it."""
    model = _Net(causal, divide).double()
    model.load_state_dict({k: torch.from_numpy(v).double() for k, v in initial.items()})
    batch = {k: torch.from_numpy(v) for k, v in _batch().items()}
    logits = model(batch["idx"])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))
    loss.backward()
    with torch.no_grad():
        after = {n: (p - LR * p.grad).numpy() for n, p in model.named_parameters()}
    return float(loss.detach()), after


def _load_with(path: Path, rewrite: Any = None, entry: str = "train") -> Any:
    """Load ``entry`` on the CPU with ``rewrite`` in the fused-attention slot."""
    original = rewrites.REWRITES
    if rewrite is not None:
        rewrites.REWRITES = tuple(
            (n, rewrite if n == "fused-attention" else r) for n, r in original
        )
    try:
        return load(
            path,
            device="cpu",
            options=LoadOptions(compile=CompileOptions(entries=entry, cache_dir=False)),
        )
    finally:
        rewrites.REWRITES = original


def _run(path: Path, fused: bool) -> tuple[float, dict[str, np.ndarray], int]:
    """One step on the CPU through the runtime, with the fused-attention rewrite forced
    (kernels interpreted) or not; also how many attentions the rewrite replaced."""
    replaced = []

    def forced(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        out = rewrites.fuse_attention(stage, ctx, "cpu", interpret=True)
        replaced.append(
            len(re.findall(r"call @stepbundle_attention\d+_\w+_main\(", out.module.text()))
        )
        return out

    trainer = _load_with(path, forced if fused else None)
    assert trainer.load_info.fused_attention == ({"train[0]": LAYERS} if fused else {})
    metrics = trainer.step(_batch())
    state = {k: np.asarray(v) for k, v in trainer.state_dict().items()}
    return float(metrics["loss"]), state, sum(replaced)


def _rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray], initial: dict) -> float:
    """The largest relative error of a parameter's update (after - before)."""
    worst = 0.0
    for k, ref in b.items():
        du, dr = a[k].astype(np.float64) - initial[k], ref - initial[k]
        worst = max(worst, float(np.linalg.norm(du - dr) / (np.linalg.norm(dr) + 1e-30)))
    return worst


@pytest.mark.parametrize(
    "causal,divide,blocks",
    [(True, False, 1), (False, False, 1), (True, True, 1), (True, False, 2)],
    ids=["causal", "unmasked", "divided", "causal-2x2-blocks"],
)
def test_fused_attention_matches_float64_as_well_as_the_traced_one(
    tmp_path: Path, causal: bool, divide: bool, blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if blocks > 1:  # a longer context than the kernels' block: the online softmax across
        # blocks, and the block above the diagonal skipped
        from stepbundle.runtime.compile import fused_attention

        monkeypatch.setattr(fused_attention, "BLOCK", T)
        monkeypatch.setitem(globals(), "T", T * blocks)
    path, initial = _export(tmp_path, causal, divide)
    loss64, after64 = _float64_step(initial, causal, divide)
    loss_plain, state_plain, n_plain = _run(path, fused=False)
    loss_fused, state_fused, n_fused = _run(path, fused=True)
    assert n_plain == 0 and n_fused == 2 * LAYERS  # a forward and a backward call each
    err_plain, err_fused = abs(loss_plain - loss64), abs(loss_fused - loss64)
    upd_plain, upd_fused = _rel(state_plain, after64, initial), _rel(state_fused, after64, initial)
    print(
        f"loss err plain {err_plain:.2e} fused {err_fused:.2e}; "
        f"update err plain {upd_plain:.2e} fused {upd_fused:.2e}"
    )
    # Both run their products in bf16 (unit roundoff 2**-8); the kernels keep the scores
    # in float32 where the traced program rounds them to bf16. The loss is one number
    # whose error is a sum of roundings (1.1e-4 and 1.7e-4 of 4.2 here): held to bf16's
    # precision; the update's error (1e-2 for both), summed over every parameter, to
    # the traced program's. A kernel with the scale doubled, or without the mask,
    # fails it (update errors 0.64 and 0.74).
    assert err_fused <= 2.0**-8 * abs(loss64)
    assert upd_fused <= 1.5 * upd_plain
    assert upd_plain < 0.05  # the bf16 step is the float64 step, to bf16's precision
    # and the fused step is not the traced one by accident of a missed rewrite
    assert any(not np.array_equal(state_plain[k], state_fused[k]) for k in state_plain)


def test_every_layers_attention_and_its_backward_are_found(tmp_path: Path) -> None:
    path, _ = _export(tmp_path)
    module, fills = _module_and_fills(path)
    sites = find_attention(module, fills)
    assert len(sites) == LAYERS
    assert all(s.do is not None and s.causal for s in sites)
    assert {s.key[:4] for s in sites} == {(BATCH, HEADS, T, WIDTH // HEADS)}
    # Without the fill's value (a graph input here) the mask cannot be trusted: no match.
    assert find_attention(module, {}) == []


def test_the_tpu_program_is_built_on_a_cpu_machine(tmp_path: Path) -> None:
    # Lowered for the TPU (jax serializes the Mosaic kernels without a chip): one
    # forward and one backward kernel, shared by the layers, called twice per layer.
    path, _ = _export(tmp_path)
    texts = []

    def tap(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        for _ in range(2):
            texts.append(rewrites.fuse_attention(stage, ctx, "tpu").module.text())
        return stage  # the CPU compiles the program as it was

    _load_with(path, tap)
    text, again = texts
    # The rewritten program is the compile cache's key: lowered twice, it is the same.
    assert text == again
    assert text.count("tpu_custom_call") == 2
    assert len(re.findall(r"call @stepbundle_attention0_(fwd|bwd)_main\(", text)) == 2 * LAYERS
    assert "stablehlo.dot_general" in text  # the rest of the step is untouched


def test_the_runtime_fuses_only_on_one_tpu_at_the_default_precision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stepbundle.runtime import fallback

    monkeypatch.setattr(fallback, "_WARNED", set())
    path, _ = _export(tmp_path)
    stages = []

    def tap(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        # a copy: the rewrites after this one change the module in place
        copy = mlir.Module.parse_text(stage.module, stage.module.text())
        stages.append((rewrites.Stage(copy, stage.program), ctx))
        return stage

    _load_with(path, tap)
    ((stage, cpu),) = stages

    def fused(**change: Any) -> bool:
        ctx = dataclasses.replace(cpu, **change)
        return rewrites.fused_attention(stage, ctx) is not stage

    assert not fused()  # the CPU keeps its program
    assert fused(platform="tpu")
    assert not fused(platform="tpu", fused_attention=False)  # --no-fused-attention
    assert not fused(platform="tpu", matmul_precision="highest")  # a CPU comparison
    with pytest.warns(UserWarning, match="did not recognize"):  # the fill unknown
        assert not fused(platform="tpu", scalar_constants={})


def _module_and_fills(path: Path) -> tuple[Any, dict[int, float]]:
    with open_bundle(path) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
        fills = {
            i: float(array_from_section(b.section(inp.section), inp.spec).item())
            for i, inp in enumerate(program.inputs)
            if inp.kind.value == "constant" and inp.spec.numel == 1
        }
    return module, fills


def _mutated(module: Any, text: str) -> Any:
    return mlir.Module.parse_text(module, text)


def _defined_by(text: str, op: str) -> set[str]:
    return set(re.findall(rf"^\s*(%[\w#]+) = {re.escape(op)} ", text, re.M))


def test_a_graph_whose_math_differs_is_not_matched(tmp_path: Path) -> None:
    # Each change makes the program compute something a causal softmax attention does
    # not: the matcher must find no site in it (it finds both in the unchanged text).
    path, _ = _export(tmp_path)
    module, fills = _module_and_fills(path)
    text = module.text()
    assert len(find_attention(_mutated(module, text), fills)) == LAYERS
    sq = f"tensor<{BATCH}x{HEADS}x{T}x{T}xf32>"
    products = {
        m.group(1)
        for m in re.finditer(rf"^\s*(%[\w#]+) = stablehlo.multiply .* : {sq}$", text, re.M)
    }
    exps = _defined_by(text, "stablehlo.exponential")

    def reduce_lines(inputs: set[str]) -> list[str]:
        return [
            line
            for line in text.splitlines()
            if "stablehlo.reduce(" in line and line.split("(")[1].split(" ")[0] in inputs
        ]

    changes = {
        # the mask broadcast over (..., k, q): the upper triangle
        "mask transposed": [
            (line, line.replace("dims = [2, 3]", "dims = [3, 2]"))
            for line in text.splitlines()
            if f"dims = [2, 3] : (tensor<{T}x{T}xi1>)" in line
        ],
        # the softmax gradient's row sum as a row max
        "gradient reduce is a max": [
            (line, line.replace("applies stablehlo.add", "applies stablehlo.maximum"))
            for line in reduce_lines(products)
        ],
        # the softmax denominator summed from one: softmax-plus-one
        "denominator from one": [
            (line, re.sub(r"init: %[\w#]+\)", "init: %stepbundle_one)", line))
            for line in reduce_lines(exps)
        ],
        # dv from p, not from p transposed
        "dv without the transpose": [
            (line, line.replace("dims = [0, 2, 1]", "dims = [0, 1, 2]"))
            for line in text.splitlines()
            if "stablehlo.transpose" in line and f"-> tensor<{BATCH * HEADS}x{T}x{T}xbf16>" in line
        ],
    }
    for what, edits in changes.items():
        assert edits, what  # the change applies (the layers share one mask)
        changed = text
        for old, new in edits:
            changed = changed.replace(old, new)
        if "stepbundle_one" in changed:
            changed = re.sub(
                r"(func.func @main\(.*\{\n)",
                r"\1    %stepbundle_one = stablehlo.constant dense<1.0> : tensor<f32>\n",
                changed,
                count=1,
            )
        assert find_attention(_mutated(module, changed), fills) == [], what


def test_the_kernels_do_not_depend_on_who_lowers_them(tmp_path: Path) -> None:
    # The rewritten program is the compile cache's key: the kernels' bytes must not name
    # the calling script's file and line (jax puts tracebacks in locations).
    from stepbundle.runtime.compile.fused_attention import kernels_for

    path, _ = _export(tmp_path)
    module, fills = _module_and_fills(path)
    site = find_attention(module, fills)[0]
    make = kernels_for("tpu")
    texts = []
    for pad, name in ((0, "first.py"), (7, "second.py")):
        scope = {"make": make, "site": site}
        exec(compile("\n" * pad + "out = make(site)", name, "exec"), scope)
        texts.append(scope["out"])
    assert texts[0] == texts[1]
    assert "first.py" not in texts[0][0] and "second.py" not in texts[1][0]


def test_a_mask_in_a_state_buffer_is_read_as_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A mask held in a state buffer is not known from the program alone; the runtime's
    # rewrite reads it as the load placed it, fuses it when it is causal, and pins it
    # (tests/exporter/test_attention_state_masks.py has the rest).
    import warnings

    from stepbundle.runtime import fallback

    monkeypatch.setattr(fallback, "_WARNED", set())
    path, _ = _export(tmp_path, buffer_mask=True)
    module, fills = _module_and_fills(path)
    assert find_attention(module, fills) == []  # the program alone: not provably causal
    kept, pinned = [], []

    def tap(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        kept.append(rewrites.fuse_attention(stage, ctx, "tpu") is stage)
        pinned.extend(ctx.pinned_state)
        return stage

    with warnings.catch_warnings():
        warnings.simplefilter("error", fallback.StepbundleFallbackWarning)
        _load_with(path, tap)
    assert kept == [False] and sorted(pinned) == [f"blocks.{i}.bias" for i in range(LAYERS)]


def test_an_eval_program_fuses_its_forward(tmp_path: Path) -> None:
    # No backward: only the forward function is lowered and called.
    path, initial = _export(tmp_path)
    loss64, _ = _float64_step(initial)

    def forced(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        return rewrites.fuse_attention(stage, ctx, "cpu", interpret=True)

    plain = _load_with(path, entry="eval")
    fused = _load_with(path, forced, entry="eval")
    assert plain.load_info.fused_attention == {}
    assert fused.load_info.fused_attention == {"eval[0]": LAYERS}
    loss_plain = float(plain.evaluate(_batch())["loss"])
    loss_fused = float(fused.evaluate(_batch())["loss"])
    assert abs(loss_fused - loss64) <= 2.0**-8 * abs(loss64)
    assert loss_fused != loss_plain  # the fused program ran, not the traced one
