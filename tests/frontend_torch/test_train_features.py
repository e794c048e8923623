"""What a training step may use, through the torch front-end: dropout and the seed, eval
entries, shape buckets, bf16 autocast, gradient accumulation with clipping.

Bundles run in this process (the runtime imports no torch, so running it beside torch
changes nothing; the lean-environment runs are in ``test_train_equivalence.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import equiv_models
import jax
import linear_adamw
import numpy as np
import pytest
import torch
import torch_cases
from equiv_harness import check_failures, compare
from equiv_models import BF16_CPU, Bounds
from support import Run, make_batches
from torch_refs import eager32

from stepbundle.export_torch import export
from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.schema.manifest import InputKind
from stepbundle.schema.rng import TORCH_XLA_MARK_STEP, advance_seed

FP32 = Bounds(1e-5, 1e-5, "the same float32 step in XLA:CPU and ATen (see test_train_equivalence)")


def run_bundle_inprocess(path: Path, batches: Any, steps: int, seed: int | None = None) -> Run:
    """Train a bundle here; repeated loads of one bundle reuse its compiled programs (the
    runtime's verified compile cache, private to the test session)."""
    trainer = load(path)
    if seed is not None:
        trainer.seed = seed
    ms = trainer.run(list(batches), steps)
    metrics = [{k: float(np.asarray(v).astype(np.float64).reshape(-1)[0]) for k, v in m.items()}
               for m in ms]  # fmt: skip
    return Run(metrics, {k: np.asarray(v) for k, v in trainer.state_dict().items()})


@pytest.fixture(scope="module")
def bundles(exported: Any) -> dict[str, Path]:
    names = ("mlp_dropout", "mlp_no_dropout", "mlp_two_buckets", "mlp_accum", "mlp_bf16")
    return {name: exported(f"torch_cases:{name}") for name in names}


def test_dropout_is_a_function_of_the_seed(bundles: dict[str, Path]) -> None:
    batches = make_batches(torch_cases.mlp_dropout(), 3)
    trainer = load(bundles["mlp_dropout"])
    m = trainer.manifest
    assert m.rng is not None and m.rng.seed == 2024 and m.rng.rule == TORCH_XLA_MARK_STEP
    train = m.entries["train"].programs[0]
    assert [i.kind for i in train.inputs].count(InputKind.RNG_SEED) == 1
    # The eval entry runs without dropout: it reads no seed.
    assert all(i.kind is not InputKind.RNG_SEED for i in m.entries["eval"].programs[0].inputs)
    a = run_bundle_inprocess(bundles["mlp_dropout"], batches, 3)
    b = run_bundle_inprocess(bundles["mlp_dropout"], batches, 3)
    c = run_bundle_inprocess(bundles["mlp_dropout"], batches, 3, seed=7)
    off = run_bundle_inprocess(bundles["mlp_no_dropout"], batches, 1)
    assert a.series("loss").tolist() == b.series("loss").tolist()  # same seed, same masks
    assert all(np.array_equal(a.state[k], b.state[k]) for k in a.state)
    assert (a.series("loss") != c.series("loss")).all()  # another seed, other masks
    assert a.series("loss")[0] != off.series("loss")[0]  # dropout did something


def test_the_seed_rule_is_the_documented_one(tmp_path: Path) -> None:
    """Random operator k of step n draws from fold_in(key(seed_n), k), seed_n advanced by
    the manifest's rule (stepbundle.export_torch.lowering's docstring)."""
    r = linear_adamw.recipe()
    r.step, r.seed = torch_cases.random_numbers_step, 12345
    export(r, tmp_path / "rng.stepbundle")
    batches = make_batches(linear_adamw.recipe(), 1)
    trainer = load(
        tmp_path / "rng.stepbundle", options=LoadOptions(compile=CompileOptions(cache_dir=False))
    )
    got = trainer.run(batches, 3)
    with jax.enable_x64(True):
        for n, metrics in enumerate(got):
            seed = advance_seed(TORCH_XLA_MARK_STEP, 12345, n)
            key = jax.random.key(np.int64(np.uint64(seed).astype(np.int64)), impl="threefry2x32")
            want_u = jax.random.uniform(jax.random.fold_in(key, 0), (3,), np.float32)
            want_n = jax.random.normal(jax.random.fold_in(key, 1), (2,), np.float32)
            np.testing.assert_array_equal(np.asarray(metrics["uniform"]), np.asarray(want_u))
            np.testing.assert_array_equal(np.asarray(metrics["normal"]), np.asarray(want_n))


def test_eval_entry_matches_eager_pytorch(bundles: dict[str, Path]) -> None:
    r = torch_cases.mlp_dropout()
    batch = {k: v.numpy() for k, v in r.example_batch.items()}
    got = load(bundles["mlp_dropout"]).evaluate(batch)
    r.model.eval()
    with torch.no_grad():
        want = torch_cases.mlp_eval(r.model, dict(r.example_batch))
    for k in ("loss", "logits"):
        w = want[k].numpy()
        np.testing.assert_allclose(np.asarray(got[k]), w, rtol=1e-5, atol=1e-5 * abs(w).max())


def test_shape_buckets_pick_the_program_of_the_batch(bundles: dict[str, Path]) -> None:
    r = torch_cases.mlp_two_buckets()
    progs = load(bundles["mlp_two_buckets"]).manifest.entries["train"].programs
    assert [p.batch[0].spec.shape for p in progs] == [(32, 20), (8, 20)]
    big = {k: v.numpy() for k, v in r.example_batch.items()}
    small = {k: v.numpy() for k, v in r.example_batches[0].items()}
    batches = [big, small, big, small]
    got = run_bundle_inprocess(bundles["mlp_two_buckets"], batches, 4)
    want = eager32(torch_cases.mlp_two_buckets, batches, 4)
    check_failures(compare(got, want, FP32, "buckets"), FP32, "two shape buckets")


@pytest.mark.parametrize(("name", "bounds"), [("mlp_accum", FP32), ("mlp_bf16", BF16_CPU)])
def test_accumulation_clipping_and_bf16_autocast_train_like_pytorch(
    bundles: dict[str, Path], name: str, bounds: Bounds
) -> None:
    recipe_fn: Any = getattr(torch_cases, name)
    batches = make_batches(recipe_fn(), 3)
    got = run_bundle_inprocess(bundles[name], batches, 4)
    want = eager32(recipe_fn, batches, 4)
    check_failures(compare(got, want, bounds, name), bounds, name)
    if name == "mlp_accum":  # clipping acted: the reported norm is the unclipped one
        assert (got.series("grad_norm") > 0.5).any()


def test_the_gpt_with_tied_weights_and_dropout_exports_and_trains(exported: Any) -> None:
    """equiv_models' GPT with its dropout on: seeded, deterministic, and not the same run as
    without dropout (test_train_equivalence compares the dropout-free one with PyTorch)."""
    with_p = exported("equiv_models:gpt_dropout")
    without = exported("equiv_models:gpt_no_dropout")
    m = load(with_p).manifest
    assert m.rng is not None and m.rng.seed == 4321
    assert any(s.aliases == ("head.weight",) for s in m.state)  # the tied embedding
    batches = make_batches(equiv_models.gpt_dropout(), 2)
    a = run_bundle_inprocess(with_p, batches, 2)
    b = run_bundle_inprocess(with_p, batches, 2)
    off = run_bundle_inprocess(without, batches, 1)
    assert a.series("loss").tolist() == b.series("loss").tolist()
    assert a.series("loss")[0] != off.series("loss")[0]
    assert np.isfinite(a.series("loss")).all()
