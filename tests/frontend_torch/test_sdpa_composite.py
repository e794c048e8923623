"""``F.scaled_dot_product_attention`` as a named operation (stablehlo/attention_composite.py).

The torch front-end writes each SDPA, forward and backward, as a ``stablehlo.composite``
whose decomposition is its own lowering. Pinned here on the CPU:

- a runtime that does not swap it runs the decomposition, bit for bit the program
  written without composites;
- the TPU's swap (splash-attention kernels, interpreted by Pallas on the CPU) of each
  form it takes, against PyTorch float64 (which shares no code with either): the
  kernels alone, and a whole training step through the runtime;
- the forms it does not take keep their decomposition and say which and why;
- Hugging Face's GPT-2 built with ``attn_implementation="sdpa"`` reaches the kernels.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stepbundle.export_torch import Recipe, aten_nn, export
from stepbundle.runtime import CompileOptions, LoadOptions, fallback, load
from stepbundle.runtime.compile import fused_attention as fa
from stepbundle.runtime.compile import rewrites
from stepbundle.schema.bindings import RngSeedInput
from stepbundle.schema.reader import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.attention_composite import Attention, find_composites

VOCAB, WIDTH, HEADS, LAYERS, BATCH, LR = 64, 128, 2, 2, 2, 0.5
HEAD = WIDTH // HEADS  # 64: a head size the kernels take


# ------------------------------------------------------------------ the kernels alone
def _attention(
    grad: bool,
    h: int,
    hk: int,
    tq: int,
    tk: int,
    causal: bool,
    scale: float,
    types: tuple[str, str, str] = ("bf16", "bf16", "bf16"),
) -> Any:
    mask = "causal" if causal else "none"
    q, k, v = types
    return Attention(
        grad, 1, h, hk, tq, tk, HEAD, HEAD, q, causal, scale, mask, 0.0, h // hk, 1,
        "" if k == q else k, "" if v == q else v,
    )  # fmt: skip


FORMS = {
    # name: (heads, kv heads, Tq, Tk, causal, scale)
    "causal": (2, 2, 128, 128, True, HEAD**-0.5),
    "unmasked": (2, 2, 128, 128, False, HEAD**-0.5),
    "scale": (2, 2, 128, 128, True, 0.3),
    "gqa": (4, 2, 128, 128, True, HEAD**-0.5),
    "tq<tk": (2, 2, 128, 256, True, HEAD**-0.5),
    "tq>tk": (2, 2, 256, 128, True, HEAD**-0.5),
    "padded": (2, 1, 96, 160, False, 0.2),
}


_JNP = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def _kernel_errors(
    form: str, types: tuple[str, str, str] = ("bf16", "bf16", "bf16"), **kernel: Any
) -> dict[str, float]:
    """Each kernel result's largest error against PyTorch float64, relative to the
    largest value; ``types``: q's, k's and v's element types; ``kernel`` changes the
    kernels' attributes (not the reference's)."""
    h, hk, tq, tk, causal, scale = FORMS[form]
    keys = jax.random.split(jax.random.key(7), 4)
    qt, kt, vt = (_JNP[t] for t in types)
    q = jax.random.normal(keys[0], (1, h, tq, HEAD), qt)
    do = jax.random.normal(keys[1], (1, h, tq, HEAD), jnp.result_type(qt, kt, vt))
    k = jax.random.normal(keys[2], (1, hk, tk, HEAD), kt)
    v = jax.random.normal(keys[3], (1, hk, tk, HEAD), vt)
    kc, ks = kernel.get("causal", causal), kernel.get("scale", scale)
    fwd = fa.composite_kernel(_attention(False, h, hk, tq, tk, kc, ks, types), interpret=True)
    bwd = fa.composite_kernel(_attention(True, h, hk, tq, tk, kc, ks, types), interpret=True)
    out, lse = jax.jit(fwd)(q, k, v)
    grads = jax.jit(bwd)(do, q, k, v, out, lse)
    # the results in the composite's types: out as q, k and v promote; each gradient
    # as its operand
    assert (out.dtype, lse.dtype) == (do.dtype, jnp.float32)
    assert [g.dtype for g in grads] == [qt, kt, vt]

    # PyTorch float64: its own SDPA (is_causal is the top-left triangle of (Tq, Tk)).
    def t64(x: Any) -> torch.Tensor:
        return torch.from_numpy(np.asarray(x, np.float64)).requires_grad_()

    q64, k64, v64 = t64(q), t64(k), t64(v)
    o64 = F.scaled_dot_product_attention(
        q64, k64, v64, is_causal=causal, scale=scale, enable_gqa=hk != h
    )
    o64.backward(t64(do).detach())
    s64 = q64.detach() @ k64.detach().repeat_interleave(h // hk, 1).transpose(-1, -2) * scale
    if causal:
        s64 = s64.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(), -torch.inf)
    want = [o64, torch.logsumexp(s64, -1), q64.grad, k64.grad, v64.grad]
    errors = {}
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want):
        ref_np = ref.detach().numpy()
        assert got.shape == ref_np.shape, name
        errors[name] = float(np.abs(np.asarray(got, np.float64) - ref_np).max())
        errors[name] /= float(np.abs(ref_np).max())
    return errors


@pytest.mark.parametrize("form", list(FORMS))
def test_the_kernels_match_pytorch_float64(form: str) -> None:
    errors = _kernel_errors(form)
    print(form, {k: f"{v:.1e}" for k, v in errors.items()})
    # bf16 inputs and results: within two bf16 ulps (2**-6) of the largest value
    # (measured: at most 9e-3, the padded form's dq)
    assert max(errors.values()) <= 2**-6, errors


@pytest.mark.parametrize("compute", ["bf16", "f32"])
@pytest.mark.parametrize("types", [("f32", "f32", "f32"), ("f32", "f32", "bf16")])
def test_float32_operands_reach_the_kernels(
    types: tuple[str, str, str], compute: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch_xla hands SDPA float32 q and k under autocast (Hugging Face's Llama, after
    # its rotary embedding) with a bf16 v. The kernels compute them in
    # fa.FLOAT32_COMPUTE, results in the composite's types (asserted in _kernel_errors).
    monkeypatch.setattr(fa, "FLOAT32_COMPUTE", compute)
    errors = _kernel_errors("gqa", types)
    print(types, compute, {k: f"{v:.1e}" for k, v in errors.items()})
    if compute == "bf16":  # the operands rounded to bf16 (the default): the bf16 bound
        assert max(errors.values()) <= 2**-6, errors
        return
    # in float32, the float32 results (out, lse, dq, dk) as close to float64 as float32
    # sums of these sizes get (measured: at most 6e-7 of the largest value), a bf16
    # gradient within one rounding to bf16 (bf16's unit roundoff, 2**-8; measured 2.2e-3)
    rounded = {"dv"} if types[2] == "bf16" else set()
    assert all(e <= 1e-5 for k, e in errors.items() if k not in rounded), errors
    assert all(errors[k] <= 2**-8 for k in rounded), errors


def test_grouped_heads_gradients_are_summed_in_the_operands_type() -> None:
    # float32 k and v of 2 key/value heads shared by 8 query heads, the kernels computing
    # in bf16 (the default): each query head's gradient is the kernels' (bf16), and a
    # group's are summed in float32, k's and v's type: dk and dv are the float32 sums of
    # what the same kernels give for k and v repeated per head. Summed in bf16 (before
    # this test), they were 4.3e-3 and 2.7e-3 of the largest value from those sums; with
    # 8 query heads on one key/value head, their errors against float64 were up to 1.6x
    # (dk) and 2.2x (dv) what they are summed in float32.
    assert fa.FLOAT32_COMPUTE == "bf16"
    h, hk = 8, 2
    keys = jax.random.split(jax.random.key(7), 4)
    q, do = (jax.random.normal(k, (1, h, 128, HEAD)) for k in keys[:2])
    k, v = (jax.random.normal(k, (1, hk, 128, HEAD)) for k in keys[2:])

    def grads(kv_heads: int, k: Any, v: Any) -> Any:
        att = _attention(False, h, kv_heads, 128, 128, True, HEAD**-0.5, ("f32",) * 3)
        fwd = fa.composite_kernel(att, interpret=True)
        bwd = fa.composite_kernel(dataclasses.replace(att, grad=True), interpret=True)
        out, lse = jax.jit(fwd)(q, k, v)
        return jax.jit(bwd)(do, q, k, v, out, lse)

    _, dk, dv = grads(hk, k, v)
    _, dk_heads, dv_heads = grads(h, *(jnp.repeat(x, h // hk, axis=1) for x in (k, v)))
    for got, heads in ((dk, dk_heads), (dv, dv_heads)):
        assert got.dtype == jnp.float32
        want = np.asarray(heads, np.float64).reshape(1, hk, h // hk, 128, HEAD).sum(axis=2)
        assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-6 * np.abs(want).max()


def test_a_kernel_computing_something_else_fails_that_bound() -> None:
    # the bound above tells a right kernel from a wrong one
    assert max(_kernel_errors("tq<tk", causal=False).values()) > 4 * 2**-6
    assert max(_kernel_errors("padded", scale=0.25).values()) > 2**-6


def test_what_the_kernels_do_not_take_is_named() -> None:
    base = _attention(False, 2, 2, 128, 128, True, 0.125)

    def why(**change: Any) -> str | None:
        from dataclasses import replace

        return fa.composite_supported(replace(base, **change))

    assert why() is None
    assert "boolean attn_mask" in str(why(mask="boolean", causal=False))
    assert "additive attn_mask" in str(why(mask="additive", causal=False))
    assert "dropout" in str(why(dropout_p=0.1))
    assert why(dtype="f32") is None and why(k_dtype="f32") is None
    assert "f16" in str(why(v_dtype="f16")) and "bf16 autocast" in str(why(v_dtype="f16"))
    assert "head size" in str(why(head_dim=32, v_dim=32))
    assert "evenly" in str(why(heads=3, kv_heads=2, groups=1))


# ------------------------------------------------------------------- whole steps
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
        kw: dict[str, Any] = {"enable_gqa": self.kv_heads != HEADS}
        if self.form.get("scale") is not None:
            kw["scale"] = self.form["scale"]
        mask = self.form.get("mask")
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if mask == "boolean":  # a causal mask made in forward (Hugging Face's way)
            kw["attn_mask"] = causal
        elif mask == "additive":
            zeros = torch.zeros(t, t, dtype=q.dtype, device=x.device)
            kw["attn_mask"] = zeros.masked_fill(~causal, float("-inf"))
        elif mask == "padding":  # keys of token 0 masked: a mask from the batch
            kw["attn_mask"] = (idx != 0)[:, None, None, :]
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


def _step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch["idx"])
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["y"].reshape(-1))
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _batch(t: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {k: rng.integers(0, VOCAB, (BATCH, t)).astype(np.int64) for k in ("idx", "y")}


def _export(tmp_path: Path, model: nn.Module, t: int, name: str = "m") -> Path:
    example = {k: torch.from_numpy(v) for k, v in _batch(t).items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    path = tmp_path / f"{name}.stepbundle"
    export(Recipe(model=model, optimizer=opt, step=_step, example_batch=example, seed=0), path)
    return path


def _net(spec: dict[str, Any]) -> nn.Module:
    """The test model of ``spec``, from seed 0 (the same weights every time)."""
    torch.manual_seed(0)
    return _Net(spec)


@pytest.fixture(scope="module")
def net_bundle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``net_bundle(spec, t)``: ``_net(spec)`` exported with context ``t``, once per module
    (several tests read or run the same bundle; each export costs seconds)."""
    folder = tmp_path_factory.mktemp("sdpa")
    done: dict[str, Path] = {}

    def get(spec: dict[str, Any], t: int) -> Path:
        key = f"{sorted(spec.items())}-{t}"
        if key not in done:
            done[key] = _export(folder, _net(spec), t, f"m{len(done)}")
        return done[key]

    return get


_PLAIN: dict[tuple[Path, int], tuple[float, dict[str, np.ndarray], str]] = {}


def _run_plain(path: Path, t: int) -> tuple[float, dict[str, np.ndarray], str]:
    """``_run(path, t, fused=False)``, once per bundle in this module (a bundle's step
    without the swap is deterministic: a second run would compute the same bits)."""
    if (path, t) not in _PLAIN:
        _PLAIN[path, t] = _run(path, t, fused=False)
    return _PLAIN[path, t]


def _float64_step(model: nn.Module, t: int) -> tuple[float, dict[str, np.ndarray]]:
    """The step in float64 without autocast: the loss and the parameters after it."""
    model = model.double()
    batch = {k: torch.from_numpy(v) for k, v in _batch(t).items()}
    logits = model(batch["idx"])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))
    loss.backward()
    with torch.no_grad():
        after = {n: (p - LR * p.grad).numpy() for n, p in model.named_parameters()}
    return float(loss.detach()), after


def _run(path: Path, t: int, fused: bool) -> tuple[float, dict[str, np.ndarray], str]:
    """One step on the CPU through the runtime, with the TPU's attention swap forced
    (kernels interpreted) or not; and the program text the swap made."""
    texts = []

    def forced(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        out = rewrites.fuse_attention(stage, ctx, "cpu", interpret=True)
        texts.append(out.module.text())
        return out

    original = rewrites.REWRITES
    if fused:
        rewrites.REWRITES = tuple((n, forced if n == "fused-attention" else r) for n, r in original)
    try:
        trainer = load(
            path, device="cpu", options=LoadOptions(compile=CompileOptions(cache_dir=False))
        )
    finally:
        rewrites.REWRITES = original
    assert trainer.load_info.fused_attention == ({"train[0]": LAYERS} if fused else {})
    metrics = trainer.step(_batch(t))
    state = {k: np.asarray(v) for k, v in trainer.state_dict().items()}
    return float(metrics["loss"]), state, "".join(texts)


def _composites(path: Path) -> list[tuple[str, Attention | None]]:
    with open_bundle(path) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
    with module._ctx:
        return [(str(op.attributes["name"]), att) for op, att in find_composites(module)]


def _rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray], initial: dict) -> float:
    """The largest relative error of a parameter's update (after - before)."""
    worst = 0.0
    for k, ref in b.items():
        du, dr = a[k].astype(np.float64) - initial[k], ref - initial[k]
        worst = max(worst, float(np.linalg.norm(du - dr) / (np.linalg.norm(dr) + 1e-30)))
    return worst


STEP_FORMS = {
    "causal": ({}, 128),
    "unmasked": ({"causal": False}, 128),
    "scale-gqa": ({"scale": 0.2, "kv_heads": 1}, 128),
    "padded": ({}, 96),
    "boolean-causal-mask": ({"mask": "boolean"}, 128),
    "additive-causal-mask": ({"mask": "additive"}, 128),
}


@pytest.mark.parametrize("form", list(STEP_FORMS))
def test_a_fused_step_matches_float64_as_well_as_the_decomposition(
    net_bundle: Any, form: str
) -> None:
    spec, t = STEP_FORMS[form]
    model = _net(spec)
    initial = {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}
    path = net_bundle(spec, t)
    found = _composites(path)
    assert [n for n, _ in found].count('"stepbundle.attention"') == LAYERS
    assert [n for n, _ in found].count('"stepbundle.attention_grad"') == LAYERS
    att = found[0][1]
    # a causal mask made in forward from constants is written as is_causal=True
    assert att is not None and (att.causal, att.q_len, att.kv_len) == (
        spec.get("causal", True),
        t,
        t,
    )
    assert att.mask == ("causal" if att.causal else "none")
    assert att.groups == HEADS // spec.get("kv_heads", HEADS)
    assert att.scale == pytest.approx(spec.get("scale") or HEAD**-0.5)
    loss64, after64 = _float64_step(model, t)
    loss_plain, state_plain, _ = _run_plain(path, t)
    loss_fused, state_fused, text = _run(path, t, fused=True)
    # every composite replaced by a call of the kernels: none left, two functions
    assert "stablehlo.composite" not in text
    assert len(re.findall(r"call @stepbundle_sdpa\d+_(fwd|bwd)_main\(", text)) == 2 * LAYERS
    err_plain, err_fused = abs(loss_plain - loss64), abs(loss_fused - loss64)
    upd_plain, upd_fused = _rel(state_plain, after64, initial), _rel(state_fused, after64, initial)
    print(
        f"{form}: loss err plain {err_plain:.2e} fused {err_fused:.2e}; "
        f"update err plain {upd_plain:.2e} fused {upd_fused:.2e}"
    )
    # Both compute in bf16 (unit roundoff 2**-8): the loss to bf16's precision, the
    # update (summed over every parameter) about as close as the decomposition's.
    assert err_fused <= 2.0**-8 * abs(loss64)
    assert upd_fused <= 1.5 * upd_plain + 1e-3
    assert upd_plain < 0.05
    # and the fused step is not the decomposed one by accident of a missed swap
    assert any(not np.array_equal(state_plain[k], state_fused[k]) for k in state_plain)


def test_sdpa_without_dropout_takes_no_seed(net_bundle: Any) -> None:
    # torch tags its SDPA kernels as random (for their dropout); with dropout_p 0 the
    # step draws nothing, so the bundle has no seed input (and the export check, which
    # cannot replay torch's random numbers, is not skipped for it).
    path = net_bundle({}, 128)
    with open_bundle(path) as b:
        inputs = b.manifest.entries["train"].programs[0].inputs
    assert inputs and not any(isinstance(i, RngSeedInput) for i in inputs)


@pytest.mark.parametrize("form", ["causal", "padding"])
def test_the_decomposition_is_the_program_without_composites_bit_for_bit(
    tmp_path: Path, net_bundle: Any, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = {} if form == "causal" else {"mask": form}
    with_composites = net_bundle(spec, 128)
    monkeypatch.setattr(aten_nn, "COMPOSITES", False)
    without = _export(tmp_path, _net(spec), 128, "without")
    kinds = {att.mask for _, att in _composites(with_composites) if att is not None}
    # PyTorch hands its CPU kernel a boolean mask as an additive one (0 / -inf)
    assert kinds == {"causal" if form == "causal" else "additive"}
    assert _composites(without) == []
    loss_a, state_a, _ = _run_plain(with_composites, 128)
    loss_b, state_b, _ = _run(without, 128, fused=False)
    assert loss_a == loss_b
    assert all(np.array_equal(state_a[k], state_b[k]) for k in state_a)


def test_a_mask_from_the_batch_keeps_the_decomposition_and_says_why(
    net_bundle: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fallback, "_WARNED", set())
    path = net_bundle({"mask": "padding"}, 128)
    kept = []

    def tap(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        kept.append(rewrites.fuse_attention(stage, ctx, "tpu") is stage)
        return stage

    original = rewrites.REWRITES
    rewrites.REWRITES = tuple((n, tap if n == "fused-attention" else r) for n, r in original)
    try:
        with pytest.warns(fallback.StepbundleFallbackWarning, match="additive attn_mask") as w:
            trainer = load(
                path, device="cpu", options=LoadOptions(compile=CompileOptions(cache_dir=False))
            )
    finally:
        rewrites.REWRITES = original
    assert kept == [True]
    # the message names the site: its shape, and what to change
    assert any("Tq 128" in str(x.message) and "is_causal=True" in str(x.message) for x in w)
    # and load_info keeps them: every layer's forward and backward, with why
    (reasons,) = trainer.load_info.attention_kept.values()
    assert len(reasons) == 2 * LAYERS and all("additive attn_mask" in r for r in reasons)


def test_the_tpu_program_is_built_on_a_cpu_machine(net_bundle: Any) -> None:
    # Lowered for the TPU (jax serializes the Mosaic kernels without a chip): a forward
    # and a backward kernel function shared by the layers, each called once per layer.
    path = net_bundle({}, 128)
    texts = []

    def tap(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        for _ in range(2):
            texts.append(rewrites.fuse_attention(stage, ctx, "tpu").module.text())
        return stage

    original = rewrites.REWRITES
    rewrites.REWRITES = tuple((n, tap if n == "fused-attention" else r) for n, r in original)
    try:
        load(path, device="cpu", options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    finally:
        rewrites.REWRITES = original
    text, again = texts
    assert text == again  # the compile cache's key: the same every time
    assert "stablehlo.composite" not in text and "tpu_custom_call" in text
    assert len(re.findall(r"call @stepbundle_sdpa\d_(fwd|bwd)_main\(", text)) == 2 * LAYERS


def test_hugging_face_gpt2_with_sdpa_reaches_the_kernels(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    assert model.config._attn_implementation == "sdpa"

    def step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> Any:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch["idx"]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["y"].reshape(-1))
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    example = {k: torch.from_numpy(v) for k, v in _batch(128).items()}
    initial = {k: v.detach().double().numpy() for k, v in model.named_parameters()}
    path = tmp_path / "gpt2.stepbundle"
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    export(Recipe(model=model, optimizer=opt, step=step, example_batch=example, seed=0), path)
    found = _composites(path)
    assert len(found) == 2 * LAYERS and all(a is not None and a.causal for _, a in found)

    model64 = model.double()
    batch = {k: torch.from_numpy(v) for k, v in _batch(128).items()}
    loss64 = F.cross_entropy(
        model64(batch["idx"]).logits.reshape(-1, VOCAB), batch["y"].reshape(-1)
    )
    loss64.backward()
    after64 = {n: (p - LR * p.grad).detach().numpy() for n, p in model64.named_parameters()}
    loss_plain, state_plain, _ = _run(path, 128, fused=False)
    loss_fused, state_fused, _ = _run(path, 128, fused=True)
    names = [k for k in state_plain if k in after64]
    assert names
    upd_plain = _rel({k: state_plain[k] for k in names}, after64, initial)
    upd_fused = _rel({k: state_fused[k] for k in names}, after64, initial)
    print(f"gpt2: update err plain {upd_plain:.2e} fused {upd_fused:.2e}")
    assert abs(loss_fused - loss64.item()) <= 2.0**-8 * abs(loss64.item())
    assert upd_fused <= 1.5 * upd_plain + 1e-3 and upd_plain < 0.05
