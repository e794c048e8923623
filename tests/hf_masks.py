"""Hugging Face's causal masks at the size they failed at, for both front-ends' tests (#38).

transformers builds a (batch, 1, T, T) mask (``masking_utils``): the causal triangle
and-ed with a packed-sequence mask computed from the position ids (a running sum, read
back with a gather). At batch 8 and T = 1024 it is 8M elements, more than the load
computed element by element, and no layer was fused (HF GPT-2 and Llama, SDPA and eager,
on the v5e). Here the same models at that batch and length but tiny widths and one layer:
the export is seconds, and the mask is the real one. ``sites`` says what the load's
matcher and the composite fold make of it, without kernels (they run at load on any
platform); a padding ``attention_mask`` given with the batch must stay unfused, its
reason naming the input.

Imports: torch, transformers, numpy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

VOCAB, T, BATCH, WIDTH, HEADS = 64, 1024, 8, 32, 2


def model(kind: str, impl: str) -> nn.Module:
    """HF GPT-2 ("gpt2") or Llama ("llama"), one layer, ``attn_implementation=impl``."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg: Any = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=T, n_embd=WIDTH, n_layer=1, n_head=HEADS,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation=impl)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=T,
    )  # fmt: skip
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=impl)


def step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    optimizer.zero_grad()
    mask = batch.get("attention_mask")
    logits = model(batch["idx"], attention_mask=mask).logits
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def batch(padding: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    out = {
        "idx": rng.integers(0, VOCAB, (BATCH, T)).astype(np.int64),
        "y": rng.integers(0, VOCAB, (BATCH, T)).astype(np.int64),
    }
    if padding:  # every row's last 100 positions are padding
        mask = np.ones((BATCH, T), np.int64)
        mask[:, -100:] = 0
        out["attention_mask"] = mask
    return out


def export_with(
    export: Any, recipe_type: Any, path: Path, kind: str, impl: str, padding: bool = False
) -> nn.Module:
    """Export the step with a front-end's ``export`` and ``Recipe`` (the export check off:
    these tests read the program, and the check would step a 1024-long batch on the CPU)."""
    net = model(kind, impl)
    example = {k: torch.from_numpy(v) for k, v in batch(padding).items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    recipe = recipe_type(model=net, optimizer=opt, step=step, example_batch=example)
    export(recipe, path, check=False)
    return net


def sites(path: Path, net: nn.Module) -> tuple[int, int, list[str]]:
    """What the load makes of the bundle's attention: the written-out attentions matched
    as causal (``find_attention``), the composites whose mask folds to ``is_causal``
    (``causal_mask_reads``), and the reasons for the rest."""
    from stepbundle.runtime.entry_compiler import scalar_constants
    from stepbundle.schema.reader import open_bundle
    from stepbundle.stablehlo import artifact as mlir
    from stepbundle.stablehlo.attention import find_attention
    from stepbundle.stablehlo.attention_composite import causal_mask_reads, find_composites

    buffers = {k: v.detach().numpy() for k, v in net.named_buffers()}
    with open_bundle(path) as b:
        program = b.manifest.entries["train"].programs[0]
        module = mlir.parse_artifact(bytes(b.section(program.section)))
        # the scalar constants the load hands the rewrites: torch_xla captures an
        # integer offset into the positions HF's masks are built from, and a load that
        # gave the rewrites floating constants only left every layer unfused on the v5e
        scalars = scalar_constants(b, program)
    state = {
        i: (inp.name, lambda n=inp.name: buffers[n].reshape(-1).tolist())
        for i, inp in enumerate(program.inputs)
        if inp.kind.value == "buffer" and inp.name in buffers
    }
    names = {
        i: f"the batch input {inp.name!r}"
        for i, inp in enumerate(program.inputs)
        if inp.kind.value == "batch"
    }
    misses: list[str] = []
    matched = find_attention(module, scalars, misses, state, names)
    assert all(s.causal and s.do is not None for s in matched)
    folded = 0
    with module._ctx:
        for op, att in find_composites(module):
            assert att is not None and att.mask in ("boolean", "additive", "causal")
            if att.mask == "causal":
                folded += 1
                continue
            reads, why = causal_mask_reads(
                op.operands[6 if att.grad else 3], att, scalars, state, names
            )
            if reads is None:
                misses.append(why)
            else:
                folded += 1
    return len(matched), folded, misses
