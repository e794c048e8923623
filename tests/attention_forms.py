"""Written-out causal attention in the forms people write it, for both front-ends' tests.

One small GPT-like model whose layers each write their causal mask another way:

- ``tril``: ``torch.ones(t, t, dtype=torch.bool).tril()`` made in ``forward``, applied
  with ``masked_fill(~mask, -inf)``;
- ``buffer``: nanoGPT's ``register_buffer("bias", tril)`` read as ``self.bias[:, :, :t,
  :t] == 0`` (a state buffer the step never writes);
- ``arange``: positions from ``torch.arange``, ``torch.where(i[:, None] >= i[None, :],
  att, -inf)``, in a layer of one head (head size 128);
- ``additive``: a float mask added to the scores, ``torch.full((t, t), finfo.min)
  .triu(1)`` (Hugging Face's eager attention adds one).

Batch 1 throughout (the rows each front-end writes for B = 1 and H = 1 are the edge the
matcher must still read). ``float64_step`` is the same step in float64 without autocast,
PyTorch on the CPU: the ground truth both front-ends' bundles are held to.

Imports: torch, numpy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

VOCAB, T, WIDTH, BATCH, LR = 64, 128, 128, 1, 0.5
FORMS = (("tril", 2), ("buffer", 2), ("arange", 1), ("additive", 2))
"""Each layer's mask form and number of heads."""
MASK_BUFFERS = tuple(f"blocks.{i}.bias" for i, (form, _) in enumerate(FORMS) if form == "buffer")


class Block(nn.Module):
    def __init__(self, form: str, heads: int) -> None:
        super().__init__()
        self.form, self.heads = form, heads
        if form == "buffer":
            self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.heads
        q, k, v = (a.view(b, t, h, c // h).transpose(1, 2) for a in self.qkv(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        if self.form == "tril":
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
        elif self.form == "buffer":
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        elif self.form == "arange":
            i = torch.arange(t, device=x.device)
            att = torch.where(i[:, None] >= i[None, :], att, float("-inf"))
        else:
            low = torch.finfo(att.dtype).min
            att = att + torch.full((t, t), low, dtype=att.dtype, device=x.device).triu(1)
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        return x + self.proj(y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(form, heads) for form, heads in FORMS])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    optimizer.zero_grad()
    with torch.autocast(batch["idx"].device.type, dtype=torch.bfloat16):
        logits = model(batch["idx"])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), batch["y"].reshape(-1))
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "idx": rng.integers(0, VOCAB, (BATCH, T)).astype(np.int64),
        "y": rng.integers(0, VOCAB, (BATCH, T)).astype(np.int64),
    }


def model_and_initial() -> tuple[Net, dict[str, np.ndarray]]:
    """The model (seed 0) and its initial state."""
    torch.manual_seed(0)
    model = Net()
    return model, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def float64_step(initial: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    """The step in float64 without autocast: the loss and the parameters after it."""
    model = Net().double()
    model.load_state_dict({k: torch.from_numpy(v).double() for k, v in initial.items()})
    data = {k: torch.from_numpy(v) for k, v in batch().items()}
    logits = model(data["idx"])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), data["y"].reshape(-1))
    loss.backward()
    with torch.no_grad():
        after = {n: (p - LR * p.grad).numpy() for n, p in model.named_parameters()}
    return float(loss.detach()), after


def update_error(
    state: dict[str, np.ndarray], after64: dict[str, np.ndarray], initial: dict[str, np.ndarray]
) -> float:
    """The largest relative error of a parameter's update (after - before)."""
    worst = 0.0
    for k, ref in after64.items():
        du, dr = state[k].astype(np.float64) - initial[k], ref - initial[k]
        worst = max(worst, float(np.linalg.norm(du - dr) / (np.linalg.norm(dr) + 1e-30)))
    return worst


def export_with(export: Any, recipe_type: Any, path: Any) -> dict[str, np.ndarray]:
    """Export the model's training step with a front-end's ``export`` and ``Recipe``
    to ``path``; returns the initial state."""
    model, initial = model_and_initial()
    example = {k: torch.from_numpy(v) for k, v in batch().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    export(recipe_type(model=model, optimizer=opt, step=step, example_batch=example, seed=0), path)
    return initial


def run(path: Any, fused: bool) -> tuple[Any, float, dict[str, np.ndarray], list[str]]:
    """One step of the bundle on the CPU through the runtime, with the TPU's
    fused-attention rewrite forced (its kernels interpreted by Pallas) or not: the
    trainer, the loss, the state after it, and the state the rewrite pinned."""
    from stepbundle.runtime import LoadOptions, load
    from stepbundle.runtime.compile import rewrites

    pinned: list[str] = []

    def forced(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
        out = rewrites.fuse_attention(stage, ctx, "cpu", interpret=True)
        pinned.extend(ctx.pinned_state)
        return out

    original = rewrites.REWRITES
    if fused:
        rewrites.REWRITES = tuple((n, forced if n == "fused-attention" else r) for n, r in original)
    try:
        options = LoadOptions.from_keywords(entry="train", cache_dir=False)
        trainer = load(path, device="cpu", options=options)
    finally:
        rewrites.REWRITES = original
    loss = float(trainer.step(batch())["loss"])
    state = {k: np.asarray(v) for k, v in trainer.state_dict().items()}
    return trainer, loss, state, pinned


def check_fused_against_float64(path: Any, initial: dict[str, np.ndarray]) -> None:
    """Every layer's attention fused, and the fused step as near PyTorch float64 as the
    traced one (the assertions both front-ends' tests make)."""
    loss64, after64 = float64_step(initial)
    plain, loss_plain, state_plain, _ = run(path, fused=False)
    fused, loss_fused, state_fused, pinned = run(path, fused=True)
    assert plain.load_info.fused_attention == {}
    assert fused.load_info.fused_attention == {"train[0]": len(FORMS)}
    assert fused.load_info.attention_kept == {}
    assert sorted(pinned) == sorted(MASK_BUFFERS)
    err_plain, err_fused = (abs(x - loss64) / abs(loss64) for x in (loss_plain, loss_fused))
    upd_plain = update_error(state_plain, after64, initial)
    upd_fused = update_error(state_fused, after64, initial)
    print(f"loss err {err_plain:.2e} / {err_fused:.2e}; update {upd_plain:.2e} / {upd_fused:.2e}")
    # Both run their products in bf16 (unit roundoff 2**-8): the loss to bf16's
    # precision, the update's error to the traced program's (as test_fused_attention)
    assert err_fused <= 2.0**-8
    assert upd_fused <= 1.5 * upd_plain and upd_plain < 0.05
    # and the fused step is not the traced one by accident of a missed rewrite
    assert any(not np.array_equal(state_plain[k], state_fused[k]) for k in after64)


def gpt2_eager_sites(export: Any, recipe_type: Any, path: Any) -> None:
    """Hugging Face's GPT-2 (two small layers) with ``attn_implementation="eager"``:
    its causal mask is a bool buffer (``attn.bias``, applied with ``torch.where``) and
    its additive mask (0 or the dtype's minimum, added after): exported, both layers'
    attention is matched with its backward, the buffers read as the model holds them;
    with a buffer that is not causal, that layer is kept and the buffer is named."""
    import transformers

    from stepbundle.runtime.dtypes import array_from_section
    from stepbundle.schema.reader import open_bundle
    from stepbundle.stablehlo import artifact as mlir
    from stepbundle.stablehlo.attention import find_attention

    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=T, n_embd=WIDTH, n_layer=2, n_head=2,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    masks = {k: v.numpy().copy() for k, v in model.named_buffers() if k.endswith("attn.bias")}

    def gpt2_step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> Any:
        optimizer.zero_grad()
        with torch.autocast(batch["idx"].device.type, dtype=torch.bfloat16):
            logits = model(batch["idx"]).logits
        loss = nn.functional.cross_entropy(
            logits.float().reshape(-1, VOCAB), batch["y"].reshape(-1)
        )
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    example = {k: torch.from_numpy(v) for k, v in batch().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    export(recipe_type(model=model, optimizer=opt, step=gpt2_step, example_batch=example), path)
    with open_bundle(path) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
        scalars = {
            i: float(array_from_section(b.section(inp.section), inp.spec).item())
            for i, inp in enumerate(program.inputs)
            if inp.kind.value == "constant" and inp.spec.numel == 1
        }
        numbers = {
            getattr(inp, "name", None): i
            for i, inp in enumerate(program.inputs)
            if getattr(inp, "name", None) in masks
        }
    assert sorted(numbers) == sorted(masks)  # state buffers, read as loaded

    def state(values: dict[str, np.ndarray]) -> dict[int, Any]:
        return {i: (n, lambda n=n: values[n].reshape(-1).tolist()) for n, i in numbers.items()}

    sites = find_attention(module, scalars, state=state(masks))
    assert len(sites) == 2 and all(s.causal and s.do is not None for s in sites)
    assert sorted(n for s in sites for n in s.state_reads) == sorted(numbers.values())
    full = dict(masks, **{"transformer.h.1.attn.bias": np.ones_like(masks[next(iter(masks))])})
    misses: list[str] = []
    assert len(find_attention(module, scalars, misses, state(full))) == 1
    assert any("transformer.h.1.attn.bias" in m and "not the causal triangle" in m for m in misses)
