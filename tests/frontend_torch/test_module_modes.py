"""The torch front-end captures each module in the mode the user left it in, and records it.

A fine-tuning recipe keeps a BatchNorm frozen (eval mode: running statistics read, never
updated) and a dropout off. The train entry runs them so, as the user's PyTorch loop does,
and ``Entry.eval_modules`` says which modules were in eval mode, as with the torch_xla
front-end (tests/exporter/test_module_modes.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from modes_net import ModesNet, modes_batch, mse_eval, mse_step, prepared
from support import Run, assert_runs_close, make_batches, max_rel_diff, train_eager_cpu

from stepbundle.export_torch import export
from stepbundle.runtime import CompileOptions, LoadOptions, load
from stepbundle.schema import StateUpdateOutput


def _recipe(frozen: bool = True):
    from stepbundle.frontend.recipe import Recipe

    torch.manual_seed(0)
    model = prepared(ModesNet(), frozen=frozen)
    if not frozen:
        model.drop1.p = 0.0  # no random numbers: the run compares with PyTorch exactly
    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        step=mse_step,
        example_batch=modes_batch(),
        eval_step=mse_eval,
    )


def _run(path: Path, batches, steps: int) -> Run:
    trainer = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    ms = trainer.run(list(batches), steps)
    metrics = [{k: float(np.asarray(v, np.float64).reshape(-1)[0]) for k, v in m.items()}
               for m in ms]  # fmt: skip
    return Run(metrics, {k: np.asarray(v) for k, v in trainer.state_dict().items()})


def test_frozen_batchnorm_and_eval_dropout_match_pytorch_eager(tmp_path: Path) -> None:
    path = tmp_path / "frozen.stepbundle"
    r = _recipe()
    before = [m.training for m in r.model.modules()]
    m = export(r, path).manifest
    assert [mod.training for mod in r.model.modules()] == before  # left as they were
    assert m.entries["train"].eval_modules == ("bn1", "drop1")
    assert m.entries["eval"].eval_modules == tuple(n for n, _ in ModesNet().named_modules())
    updated = {o.state for o in m.entries["train"].programs[0].outputs
               if isinstance(o, StateUpdateOutput)}  # fmt: skip
    assert "bn1.running_mean" not in updated and "bn1.num_batches_tracked" not in updated
    assert {"bn2.running_mean", "bn2.running_var"} <= updated
    assert m.rng is None  # the only dropout is off: no seed input

    batches = make_batches(_recipe(), 3)
    got = _run(path, batches, 3)
    f32 = train_eager_cpu(_recipe, batches, 3)  # PyTorch, same modes
    worst = assert_runs_close(got, f32, rtol=1e-5, what="frozen", state=False)
    print(f"frozen: losses vs PyTorch eager float32 {worst['metric']:.3g}")
    # State, against the float64 arbiter: a few tensors are ill-conditioned here (the
    # frozen BatchNorm's bias and its momentum; PyTorch float32 is 9e-6 from float64 on
    # them, the bundle 1.3e-5, measured), so the bundle must be as close to float64 as
    # PyTorch float32 is (within 2x), as in tests/exporter/test_module_modes.py.
    f64 = train_eager_cpu(_recipe, batches, 3, float64=True)
    assert set(f64.state) <= set(got.state) | {k for k in f64.state if k.endswith(".grad")}
    for name, ref in f64.state.items():
        if name not in got.state:
            continue
        d, d32 = max_rel_diff(got.state[name], ref), max_rel_diff(f32.state[name], ref)
        assert d <= max(2 * d32, 1e-6), (name, d, d32)
    np.testing.assert_array_equal(got.state["bn1.running_var"], np.full(16, 2.0, np.float32))


def test_the_all_train_twin_is_another_run(tmp_path: Path) -> None:
    """The frozen bundle is not the all-train one: the test above could tell them apart."""
    path = tmp_path / "trained.stepbundle"
    m = export(_recipe(frozen=False), path).manifest
    assert m.entries["train"].eval_modules == ()
    batches = make_batches(_recipe(), 3)
    got = _run(path, batches, 2)
    ref = train_eager_cpu(lambda: _recipe(frozen=False), batches, 2)
    assert_runs_close(got, ref, rtol=1e-5, what="trained")
    frozen = train_eager_cpu(_recipe, batches, 2)
    assert abs(frozen.metrics[0]["loss"] - got.metrics[0]["loss"]) > 1e-3
    assert not np.allclose(got.state["bn1.running_mean"], 0.5)


def test_a_model_in_eval_mode_trains_in_eval_mode(tmp_path: Path) -> None:
    """A Hugging Face from_pretrained model starts in eval mode: captured so."""

    def recipe():
        r = _recipe(frozen=False)
        r.model.eval()
        return r

    path = tmp_path / "all-eval.stepbundle"
    m = export(recipe(), path).manifest
    assert m.entries["train"].eval_modules == tuple(n for n, _ in ModesNet().named_modules())
    batches = make_batches(recipe(), 3)
    assert_runs_close(_run(path, batches, 2), train_eager_cpu(recipe, batches, 2), rtol=1e-5)
