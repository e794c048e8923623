"""``F.scaled_dot_product_attention`` through the torch_xla front-end, as composites.

The tracer writes each SDPA, forward and backward, as the ``stepbundle.attention`` /
``stepbundle.attention_grad`` composites the torch front-end writes
(exporter/attention_composites.py). Pinned here on the CPU:

- the composites' attributes are the torch front-end's, per form;
- a runtime that does not swap them runs the decomposition, bit for bit the same math
  traced without the marks;
- that decomposition is as close to PyTorch float64 as torch_xla's own SDPA (traced
  without composites);
- the TPU's swap (splash kernels, interpreted by Pallas on the CPU) takes them, in a
  training step and in an eval program (whose forward composite has no lse result);
- what the kernels do not take keeps its decomposition and says why;
- float32 q and k with a bf16 v (Hugging Face's Llama under autocast: torch_xla does not
  autocast SDPA) reach the kernels too, their results in the composite's types;
- a causal mask given as ``attn_mask`` (kept in the bundle as a boolean mask) is
  computed when the program is compiled and fused as ``is_causal``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.exporter import Recipe, attention_composites, export
from stepbundle.runtime import CompileOptions, LoadOptions, fallback, load
from stepbundle.runtime.compile import rewrites
from stepbundle.schema.reader import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.attention_composite import Attention, find_composites

VOCAB, WIDTH, HEADS, LAYERS, BATCH, LR, T = 64, 128, 2, 1, 2, 0.5, 128
HEAD = WIDTH // HEADS  # 64: a head size the kernels take


class _Block(nn.Module):
    def __init__(self, form: dict[str, Any]) -> None:
        super().__init__()
        self.form = form
        self.kv_heads = form.get("kv_heads", HEADS)
        self.q = nn.Linear(WIDTH, WIDTH)
        self.kv = nn.Linear(WIDTH, 2 * self.kv_heads * HEAD)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q = self.q(x).view(b, t, HEADS, HEAD).transpose(1, 2)
        k, v = (
            a.view(b, t, self.kv_heads, HEAD).transpose(1, 2)
            for a in self.kv(x).split(self.kv_heads * HEAD, dim=2)
        )
        if self.form.get("f32_qk"):  # Hugging Face's Llama under autocast: q and k come
            # out of its float32 rotary embedding, v stays bf16 (torch_xla takes the mix);
            # a float32 factor for the rotation, so that q and k are not bf16's values
            # (rounding them to bf16 in the kernels then rounds something)
            like = torch.float32 if q.dtype == torch.bfloat16 else q.dtype
            rot = torch.linspace(0.7, 1.3, HEAD, dtype=like, device=x.device)
            q, k = (a.to(like) * rot for a in (q, k))
        kw: dict[str, Any] = {"enable_gqa": self.kv_heads != HEADS}
        if self.form.get("scale") is not None:
            kw["scale"] = self.form["scale"]
        if self.form.get("mask") == "padding":  # keys of token 0 masked: from the batch
            kw["attn_mask"] = (idx != 0)[:, None, None, :]
        elif self.form.get("mask") == "tril":  # a causal mask given as attn_mask
            kw["attn_mask"] = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        else:
            kw["is_causal"] = self.form.get("causal", True)
        y = F.scaled_dot_product_attention(q, k, v, **kw)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Net(nn.Module):
    def __init__(self, form: dict[str, Any]) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([_Block(form) for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, idx)
        return self.head(x)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast(batch["idx"].device.type, dtype=torch.bfloat16):
        logits = model(batch["idx"])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["y"].reshape(-1))


def _step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    optimizer.zero_grad()
    loss = _loss(model, batch)
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _eval(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"loss": _loss(model, batch)}


def _batch(i: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3 + i)
    return {k: rng.integers(0, VOCAB, (BATCH, T)).astype(np.int64) for k in ("idx", "y")}


def _model(form: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return _Net(form)


def _export(directory: Path, form: dict[str, Any], name: str) -> Path:
    model = _model(form)
    example = {k: torch.from_numpy(v) for k, v in _batch().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    path = directory / f"{name}.stepbundle"
    recipe = Recipe(
        model=model, optimizer=opt, step=_step, eval_step=_eval, example_batch=example, seed=0
    )
    export(recipe, path)
    return path


FORMS: dict[str, dict[str, Any]] = {
    "causal": {},
    "unmasked": {"causal": False},
    "scale-gqa": {"scale": 0.2, "kv_heads": 1},
    "padding": {"mask": "padding"},
    "tril-mask": {"mask": "tril"},
    "f32-qk": {"f32_qk": True},
}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each form with composites; the causal form also traced without the marks (the
    same math) and without composites (torch_xla's own SDPA)."""
    directory = tmp_path_factory.mktemp("sdpa_xla")
    out = {form: _export(directory, spec, form) for form, spec in FORMS.items()}
    try:
        attention_composites.MARKS = False
        out["unmarked"] = _export(directory, {}, "unmarked")
        attention_composites.MARKS = True
        attention_composites.COMPOSITES = False
        out["native"] = _export(directory, {}, "native")
    finally:
        attention_composites.MARKS = True
        attention_composites.COMPOSITES = True
    return out


def _composites(path: Path, entry: str = "train") -> list[tuple[str, Attention | None, int]]:
    with open_bundle(path) as b:
        program = b.manifest.entries[entry].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
    with module._ctx:
        return [
            (str(op.attributes["name"]).strip('"'), att, len(op.results))
            for op, att in find_composites(module)
        ]


def _load(path: Path, fused: bool, entry: str = "train") -> Any:
    """The bundle loaded on the CPU, with the TPU's attention swap forced (kernels
    interpreted) or not."""

    def forced(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        return rewrites.fuse_attention(stage, ctx, "cpu", interpret=True)

    original = rewrites.REWRITES
    if fused:
        rewrites.REWRITES = tuple((n, forced if n == "fused-attention" else r) for n, r in original)
    try:
        return load(
            path,
            device="cpu",
            options=LoadOptions(compile=CompileOptions(entries=entry, cache_dir=False)),
        )
    finally:
        rewrites.REWRITES = original


STEPS = 2
_RUNS: dict[tuple[Path, bool], tuple[list[float], dict[str, np.ndarray], list[str]]] = {}


def _run(path: Path, fused: bool = False) -> tuple[list[float], dict[str, np.ndarray], list[str]]:
    """STEPS steps of ``path`` on the CPU: the losses, the state after them, and the
    warnings of its load (each bundle loaded once per way, for every test)."""
    if (path, fused) not in _RUNS:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            trainer = _load(path, fused)
        assert trainer.load_info.fused_attention == ({"train[0]": LAYERS} if fused else {})
        losses = [float(trainer.step(_batch(i))["loss"]) for i in range(STEPS)]
        state = {k: np.asarray(v) for k, v in trainer.state_dict().items()}
        _RUNS[(path, fused)] = (losses, state, [str(w.message) for w in said])
    return _RUNS[(path, fused)]


def _float64(form: dict[str, Any]) -> tuple[list[float], dict[str, np.ndarray], dict]:
    """PyTorch float64 on the CPU, no autocast: the losses of STEPS SGD steps, the
    parameters after them, and before."""
    model = _model(form).double()
    initial = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for i in range(STEPS):
        batch = {k: torch.from_numpy(v) for k, v in _batch(i).items()}
        opt.zero_grad()
        loss = F.cross_entropy(model(batch["idx"]).reshape(-1, VOCAB), batch["y"].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().numpy() for n, p in model.named_parameters()}, initial


def _rel(got: dict[str, np.ndarray], want: dict[str, np.ndarray], initial: dict) -> float:
    """The largest relative error of a parameter's movement (after - before)."""
    worst = 0.0
    for k, ref in want.items():
        du, dr = got[k].astype(np.float64) - initial[k], ref - initial[k]
        worst = max(worst, float(np.linalg.norm(du - dr) / (np.linalg.norm(dr) + 1e-30)))
    return worst


@pytest.mark.parametrize("form", list(FORMS))
def test_the_composites_carry_the_torch_front_ends_attributes(
    bundles: dict[str, Path], form: str
) -> None:
    spec = FORMS[form]
    found = _composites(bundles[form])
    names = [n for n, _, _ in found]
    assert names.count("stepbundle.attention") == LAYERS
    assert names.count("stepbundle.attention_grad") == LAYERS
    for _, att, results in found:
        assert att is not None and att.version == 1
        assert results == (3 if att.grad else 2)  # (dq, dk, dv); (out, lse)
        causal = spec.get("causal", True) and spec.get("mask") is None
        mask = "boolean" if spec.get("mask") else ("causal" if causal else "none")
        assert (att.causal, att.mask, att.dropout_p) == (causal, mask, 0.0)
        assert (att.q_len, att.kv_len, att.head_dim) == (T, T, HEAD)
        assert att.dtypes() == (("f32", "f32", "bf16") if spec.get("f32_qk") else ("bf16",) * 3)
        assert att.groups == HEADS // spec.get("kv_heads", HEADS)
        assert att.kv_heads == spec.get("kv_heads", HEADS)
        assert att.scale == pytest.approx(spec.get("scale") or HEAD**-0.5)
    # the eval program's forward: out alone (nothing reads its lse)
    evals = _composites(bundles[form], "eval")
    assert [(n, r) for n, _, r in evals] == [("stepbundle.attention", 1)] * LAYERS
    # torch_xla's own SDPA, and the unmarked math, hold none
    assert _composites(bundles["native"]) == [] and _composites(bundles["unmarked"]) == []


def test_the_decomposition_runs_bit_for_bit_the_unmarked_math(bundles: dict[str, Path]) -> None:
    losses_a, state_a, _ = _run(bundles["causal"])
    losses_b, state_b, _ = _run(bundles["unmarked"])
    assert losses_a == losses_b
    assert all(np.array_equal(state_a[k], state_b[k]) for k in state_a)


@pytest.mark.parametrize("form", ["causal", "scale-gqa", "padding", "tril-mask", "f32-qk"])
def test_the_decomposition_and_the_kernels_match_float64_as_torch_xlas_sdpa_does(
    bundles: dict[str, Path], form: str
) -> None:
    losses64, after64, initial = _float64(FORMS[form])
    losses, state, _ = _run(bundles[form])
    err = _rel(state, after64, initial)
    loss_err = max(abs(a - b) for a, b in zip(losses, losses64))
    # bf16 products (unit roundoff 2**-8): the losses to bf16's precision, the
    # parameters' movement (every parameter) within a few percent of float64's
    assert loss_err <= 2.0**-8 * max(losses64)
    assert err < 0.05
    if form == "causal":  # torch_xla's own SDPA, the traced form, against the same
        _, native, _ = _run(bundles["native"])
        err_native = _rel(native, after64, initial)
        print(f"native update err {err_native:.2e}")
        assert err <= 1.5 * err_native + 1e-3
    if form == "padding":  # a mask from the batch: kept (the next test)
        print(f"{form}: update err {err:.2e}; loss err {loss_err:.2e}")
        return
    kernel_losses, kernel, said = _run(bundles[form], fused=True)
    err_kernel = _rel(kernel, after64, initial)
    print(f"{form}: update err {err:.2e} fused {err_kernel:.2e}; loss err {loss_err:.2e}")
    assert max(abs(a - b) for a, b in zip(kernel_losses, losses64)) <= 2.0**-8 * max(losses64)
    assert err_kernel <= 1.5 * err + 1e-3
    # the swap happened (another program, other roundings), and nothing was left over
    assert any(not np.array_equal(state[k], kernel[k]) for k in state)
    assert not any("kept" in m for m in said), said


@pytest.mark.parametrize("form", ["causal", "f32-qk"])
def test_an_eval_program_swaps_its_forward(bundles: dict[str, Path], form: str) -> None:
    # f32-qk: the forward composite without lse, of float32 q and k and a bf16 v
    plain = _load(bundles[form], False, "eval")
    fused = _load(bundles[form], True, "eval")
    assert fused.load_info.fused_attention == {"eval[0]": LAYERS}
    # (causal: bf16 outputs from float32 scores either way, here the same bits; f32-qk:
    # the kernels compute in bf16, the decomposition in float32)
    a, b = (float(t.evaluate(_batch())["loss"]) for t in (plain, fused))
    print(f"{form}: eval loss {a!r} decomposition, {b!r} kernels")
    assert abs(a - b) <= 2.0**-8 * abs(a)


def test_a_mask_from_the_batch_keeps_the_decomposition_and_says_why(
    bundles: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fallback, "_WARNED", set())
    with pytest.warns(fallback.StepbundleFallbackWarning, match="boolean attn_mask"):
        trainer = _load(bundles["padding"], True)
    assert trainer.load_info.fused_attention == {}
    (reasons,) = trainer.load_info.attention_kept.values()
    assert len(reasons) == 2 * LAYERS and all("boolean attn_mask" in r for r in reasons)
    assert all(re.search(r"Tq 128, Tk 128, bf16", r) for r in reasons)
