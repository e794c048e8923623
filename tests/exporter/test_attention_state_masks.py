"""A causal mask held in a state buffer (nanoGPT's ``bias``), fused when it is safe.

The torch_xla export of a GPT whose blocks read ``self.bias[:, :, :t, :t] == 0``
hands the mask to the step as a buffer it never writes. The TPU's fused-attention
rewrite (forced here on the CPU, the kernels interpreted) computes the mask from the
value the load placed and fuses only when it is the causal triangle; the trainer then
refuses new state that changes such a buffer (``runtime/compile/state_masks.py``). A
mask that is not causal when loaded (``init_from``) keeps the traced attention, and
``load_info`` says which buffer and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_fused_attention as tfa

from stepbundle.runtime import LoadOptions, load
from stepbundle.runtime.compile import rewrites
from stepbundle.runtime.compile.state_masks import FusedMaskError
from stepbundle.stablehlo.attention import NOT_CAUSAL, find_attention

MASKS = [f"blocks.{i}.bias" for i in range(tfa.LAYERS)]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    return tfa._export(tmp_path_factory.mktemp("state_masks"), buffer_mask=True)


def _forced(stage: rewrites.Stage, ctx: rewrites.RewriteContext) -> rewrites.Stage:
    return rewrites.fuse_attention(stage, ctx, "cpu", interpret=True)


def _load(path: Path, fused: bool, **keywords: Any) -> Any:
    original = rewrites.REWRITES
    if fused:
        rewrites.REWRITES = tuple(
            (n, _forced if n == "fused-attention" else r) for n, r in original
        )
    try:
        options = LoadOptions.from_keywords(entry="train", cache_dir=False, **keywords)
        return load(path, device="cpu", options=options)
    finally:
        rewrites.REWRITES = original


@pytest.fixture(scope="module")
def fused(bundle: tuple[Path, Any]) -> Any:
    """The bundle loaded with the swap forced, once for the module (each such load lowers
    and compiles the interpreted kernels): one test steps it, the other reads its state
    and is refused, which replaces nothing (that test checks so)."""
    return _load(bundle[0], True)


def _state_values(path: Path, bias: np.ndarray) -> dict[int, tuple[str, Any]]:
    """@main's mask buffers (by argument number), each holding ``bias``."""
    from stepbundle.schema.reader import open_bundle

    with open_bundle(path) as b:
        program = b.manifest.entries["train"].programs[0]
        return {
            i: (inp.name, lambda: bias.reshape(-1).astype(np.float64).tolist())
            for i, inp in enumerate(program.inputs)
            if getattr(inp, "name", None) in MASKS
        }


def test_the_matcher_reads_the_buffer_as_loaded(bundle: tuple[Path, Any]) -> None:
    path, _ = bundle
    module, fills = tfa._module_and_fills(path)
    tril = np.tril(np.ones((tfa.T, tfa.T), np.float32)).reshape(1, 1, tfa.T, tfa.T)
    sites = find_attention(module, fills, state=_state_values(path, tril))
    assert len(sites) == tfa.LAYERS and all(s.causal and s.do is not None for s in sites)
    assert sorted(len(s.state_reads) for s in sites) == [1] * tfa.LAYERS
    # without the values (state the step writes, say): not provably causal
    misses: list[str] = []
    assert find_attention(module, fills, misses) == []
    assert misses and all(m.startswith(NOT_CAUSAL) for m in misses)
    # a full mask, and the upper triangle: not causal, and the buffer is named
    for wrong in (np.ones_like(tril), np.triu(np.ones((tfa.T, tfa.T), np.float32))[None, None]):
        misses = []
        assert find_attention(module, fills, misses, _state_values(path, wrong)) == []
        assert any("blocks.0.bias" in m and "not the causal triangle" in m for m in misses)


def test_a_causal_buffer_is_fused_and_matches_float64(bundle: tuple[Path, Any], fused: Any) -> None:
    path, initial = bundle
    # the same model with its mask made in forward: the buffer is not a parameter
    loss64, after64 = tfa._float64_step({k: v for k, v in initial.items() if k not in MASKS})
    plain = _load(path, False)
    assert fused.step_count == 0  # the shared trainer has not stepped yet
    assert plain.load_info.fused_attention == {}
    assert fused.load_info.fused_attention == {"train[0]": tfa.LAYERS}
    results = []
    for trainer in (plain, fused):
        loss = float(trainer.step(tfa._batch())["loss"])
        state = {k: np.asarray(v) for k, v in trainer.state_dict().items()}
        results.append((abs(loss - loss64), tfa._rel(state, after64, initial), state))
    (err_plain, upd_plain, state_plain), (err_fused, upd_fused, state_fused) = results
    print(f"loss err {err_plain:.2e} / {err_fused:.2e}; update {upd_plain:.2e} / {upd_fused:.2e}")
    assert err_fused <= 2.0**-8 * abs(loss64)
    assert upd_fused <= 1.5 * upd_plain and upd_plain < 0.05
    assert any(not np.array_equal(state_plain[k], state_fused[k]) for k in state_plain)


def test_replacing_the_buffer_is_refused_and_init_from_checks_it_again(
    bundle: tuple[Path, Any], fused: Any, tmp_path: Path
) -> None:
    path, _ = bundle
    values = fused.state_dict(include_aliases=False)
    fused.load_state_dict(values)  # the same mask: accepted
    changed = dict(values)
    changed["blocks.1.bias"] = np.ones_like(values["blocks.1.bias"])  # full attention
    before = fused.state_dict(include_aliases=False)
    with pytest.raises(FusedMaskError, match=r"'blocks.1.bias'.*train\[0\].*init_from"):
        fused.load_state_dict(changed)
    after = fused.state_dict(include_aliases=False)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing replaced
    # a checkpoint holding the changed mask: refused by load_checkpoint as well
    plain = _load(path, False)
    plain.load_state_dict(changed)  # an unfused program reads the buffer: fine
    ckpt = tmp_path / "full.safetensors"
    plain.save_checkpoint(ckpt)
    with pytest.raises(FusedMaskError):
        fused.load_checkpoint(ckpt)
    # loaded from that checkpoint, the mask is checked as loaded: kept, and said why
    # (layer 0's mask is still causal: that layer alone is fused)
    again = _load(path, True, init_from=str(ckpt))
    assert again.load_info.fused_attention == {"train[0]": 1}
    (reasons,) = again.load_info.attention_kept.values()
    assert any("blocks.1.bias" in r and "not the causal triangle" in r for r in reasons)
    assert np.isfinite(float(again.step(tfa._batch())["loss"]))
