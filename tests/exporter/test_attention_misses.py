"""Attention the matcher must not fuse, and must say why (stablehlo/attention.py).

One torch_xla export holds a causal self-attention (its mask ``ones(t, t).tril()``,
which torch_xla writes from iotas) and a cross-attention (queries and keys of different
lengths). The cross-attention is kept with its own reason, and the runtime's rewrite
warns with it, as it does for the other attention it keeps.

The causal mask is then rebuilt with its positions in other element types (the iotas
themselves, or a convert after them): positions rounded to bf16 (past 256) or wrapped in
int8 (past 127) no longer compare into the lower triangle, and the matcher, which reads
and computes a mask in its element types, must refuse such a mask as "not provably
causal" instead of fusing it as causal. PyTorch, computing the same positions on the CPU,
is the oracle of which masks are causal.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stepbundle.exporter import Recipe, export
from stepbundle.runtime import CompileOptions, LoadOptions, fallback, load
from stepbundle.runtime.compile import rewrites
from stepbundle.runtime.dtypes import array_from_section
from stepbundle.schema.reader import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.attention import NOT_CAUSAL, find_attention

T, WIDTH, HEAD, VOCAB, BATCH = 384, 16, 8, 16, 2  # T past 256: bf16 cannot hold it
SELF_HEADS, CROSS_HEADS = 2, 3


class _Attention(nn.Module):
    """Written-out attention with ``heads`` heads of size HEAD: causal self-attention, or
    (``cross``) attention from the tokens to the first half of them, unmasked."""

    def __init__(self, heads: int, cross: bool) -> None:
        super().__init__()
        self.heads, self.cross = heads, cross
        self.q = nn.Linear(WIDTH, heads * HEAD)
        self.k = nn.Linear(WIDTH, heads * HEAD)
        self.v = nn.Linear(WIDTH, heads * HEAD)
        self.out = nn.Linear(heads * HEAD, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        src = x[:, : t // 2] if self.cross else x

        def split(a: torch.Tensor) -> torch.Tensor:
            return a.view(b, a.shape[1], self.heads, HEAD).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(src)), split(self.v(src))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HEAD))
        if not self.cross:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, self.heads * HEAD)
        return x + self.out(y)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([_Attention(SELF_HEADS, False), _Attention(CROSS_HEADS, True)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(batch["idx"]).reshape(-1, VOCAB), batch["y"].view(-1))
    loss.backward()
    optimizer.step()
    return {"loss": loss}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = _Net()
    g = torch.Generator().manual_seed(1)
    batch = {
        "idx": torch.randint(0, VOCAB, (BATCH, T), generator=g),
        "y": torch.randint(0, VOCAB, (BATCH, T), generator=g),
    }
    path = tmp_path_factory.mktemp("misses") / "attn.stepbundle"
    export(Recipe(model, torch.optim.SGD(model.parameters(), lr=0.1), _step, batch), path)
    return path


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


def test_a_cross_attention_is_named(bundle: Path) -> None:
    module, fills = _module_and_fills(bundle)
    misses: list[str] = []
    sites = find_attention(module, fills, misses)
    assert [(s.heads, s.causal) for s in sites] == [(SELF_HEADS, True)]
    assert misses == [
        f"a cross-attention (queries of length {T}, keys of length {T // 2}): the fused "
        "kernels take self-attention only, queries and keys of one length"
    ]


def test_the_runtime_warns_with_the_reason(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fallback, "_WARNED", set())
    original = rewrites.REWRITES

    def tap(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        rewrites.fuse_attention(stage, ctx, "tpu")  # as on a TPU; the CPU keeps its program
        return stage

    rewrites.REWRITES = tuple((n, tap if n == "fused-attention" else r) for n, r in original)
    try:
        with pytest.warns(fallback.StepbundleFallbackWarning) as record:
            load(bundle, device="cpu", options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    finally:
        rewrites.REWRITES = original
    said = [str(w.message) for w in record]
    assert any(
        m.startswith("stepbundle kept traced attention it did not recognize: a cross-attention")
        for m in said
    ), said
    # The self-attention was found; its q is float32, so the kernels skip it, saying so.
    assert any(m.startswith("stepbundle kept traced attention: q is f32") for m in said), said


_TORCH = {"i32": torch.int32, "i16": torch.int16, "i8": torch.int8}
_TORCH |= {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _retyped(text: str, elem: str, via_convert: bool) -> str:
    """``text`` with the causal mask's positions (torch_xla's ``iota : tensor<Txi32>``
    and the broadcasts and compare that read it) in ``elem``: the iota itself in that
    type, or (``via_convert``) converted to it after the iota."""
    (iota,) = re.findall(rf"^\s*(%[\w#]+) = stablehlo.iota dim = 0 : tensor<{T}xi32>$", text, re.M)
    pos = iota
    if via_convert:
        pos = f"%positions_as_{elem}"
        text = re.sub(
            rf"^(\s*){re.escape(iota)} = stablehlo.iota dim = 0 : tensor<{T}xi32>$",
            rf"\g<0>\n\1{pos} = stablehlo.convert {iota} : (tensor<{T}xi32>) -> tensor<{T}x{elem}>",
            text,
            flags=re.M,
        )
    else:
        text = text.replace(
            f"{iota} = stablehlo.iota dim = 0 : tensor<{T}xi32>",
            f"{iota} = stablehlo.iota dim = 0 : tensor<{T}x{elem}>",
        )
    sides = []
    for dim in (0, 1):
        old = re.search(
            rf"^\s*(%[\w#]+) = stablehlo.broadcast_in_dim {re.escape(iota)}, dims = \[{dim}\] "
            rf": \(tensor<{T}xi32>\) -> tensor<{T}x{T}xi32>$",
            text,
            re.M,
        )
        assert old is not None
        sides.append(old.group(1))
        text = text.replace(
            old.group(0),
            old.group(0)
            .replace(f"broadcast_in_dim {iota},", f"broadcast_in_dim {pos},")
            .replace("xi32>", f"x{elem}>"),
        )
    compare = re.search(
        rf"^\s*%[\w#]+ = stablehlo.compare  GE, {sides[0]}, {sides[1]} : .*$", text, re.M
    )
    assert compare is not None
    return text.replace(compare.group(0), compare.group(0).replace("xi32>", f"x{elem}>"))


def _causal_in_pytorch(elem: str) -> bool:
    """The oracle: the positions 0..T-1 in ``elem``, compared by PyTorch on the CPU."""
    pos = torch.arange(T).to(_TORCH[elem])
    return torch.equal(pos[:, None] >= pos[None, :], torch.ones(T, T, dtype=torch.bool).tril())


@pytest.mark.parametrize("via_convert", [False, True], ids=["iota", "convert"])
@pytest.mark.parametrize("elem", ["i32", "i16", "f32", "f16", "bf16", "i8"])
def test_a_mask_in_other_element_types_is_causal_only_when_it_is(
    bundle: Path, elem: str, via_convert: bool
) -> None:
    module, fills = _module_and_fills(bundle)
    text = module.text()
    changed = mlir.Module.parse_text(module, _retyped(text, elem, via_convert))
    misses: list[str] = []
    sites = find_attention(changed, fills, misses)
    causal = _causal_in_pytorch(elem)
    # The oracle itself: rounding and wrapping do break the mask at this length.
    assert causal == (elem not in ("bf16", "i8"))
    if causal:
        assert [(s.heads, s.causal) for s in sites] == [(SELF_HEADS, True)]
    else:
        assert sites == []
        assert any(m.startswith(NOT_CAUSAL) for m in misses), misses
