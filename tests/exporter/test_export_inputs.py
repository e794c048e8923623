"""RNG seeds, hyperparameters, host scalars and the refusals (issue #4)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from export_helpers import check_equivalent, linear_sgd_recipe, mse_step, regression_batch
from support import make_batches, run_bundle_inprocess

from stepbundle.exporter import ExportError, Recipe, export
from stepbundle.runtime import CompileOptions, LoadOptions
from stepbundle.schema import BundleError, InputKind


# ------------------------------------------------------------ RNG
class _Drop(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = torch.nn.functional.dropout(torch.relu(self.fc1(x)), 0.5, self.training)
        return self.fc2(torch.nn.functional.dropout(h, 0.2, self.training))


def _dropout_recipe(seed: int = 4242):
    def recipe() -> Recipe:
        torch.manual_seed(0)
        model = _Drop()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, capturable=True, foreach=False)
        return Recipe(
            model=model, optimizer=opt, step=mse_step, example_batch=regression_batch(), seed=seed
        )

    return recipe


def test_dropout_reproduces_torch_xla_masks(tmp_path: Path) -> None:
    m = check_equivalent(_dropout_recipe(), tmp_path, steps=4, seed=4242)
    prog = m.entries["train"].programs[0]
    seeds = [i for i in prog.inputs if i.kind is InputKind.RNG_SEED]
    assert len(seeds) == 1 and seeds[0].spec.dtype.value == "i64"
    assert m.rng is not None and m.rng.seed == 4242


def test_runtime_seed_can_be_set(tmp_path: Path) -> None:
    # A bundle exported with seed 1 and run with seed 77 equals torch_xla eager at 77.
    check_equivalent(_dropout_recipe(seed=1), tmp_path, steps=3, seed=77)


def test_no_dropout_no_seed(tmp_path: Path) -> None:
    def recipe() -> Recipe:
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        return Recipe(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            step=mse_step,
            example_batch=regression_batch(),
        )

    export(recipe(), tmp_path / "b.stepbundle")
    from stepbundle.schema import open_bundle

    with open_bundle(tmp_path / "b.stepbundle") as b:
        assert b.manifest.rng is None


# ------------------------------------------------------------ hyperparameters
def _lr_recipe(make_opt, hyper=("lr",)):
    def recipe() -> Recipe:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        return Recipe(
            model=model,
            optimizer=make_opt(model.parameters()),
            step=mse_step,
            example_batch=regression_batch(),
            hyperparameters=hyper,
        )

    return recipe


def _torch_warmup_cosine(steps: int, warmup: int, peak: float) -> list[float]:
    """The lr of each step, from torch's own schedulers (LinearLR then CosineAnnealingLR)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=peak)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(
                opt, start_factor=1e-3, end_factor=1.0, total_iters=warmup
            ),
            torch.optim.lr_scheduler.CosineAnnealingLR(
                opt, T_max=steps - warmup, eta_min=peak * 0.1
            ),
        ],
        milestones=[warmup],
    )
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize(
    "kind, make_opt",
    [
        ("adamw", lambda p: torch.optim.AdamW(p, lr=0.02, capturable=True, foreach=False)),
        ("sgd", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    ],
)
def test_declared_lr_follows_torch_scheduler(kind: str, make_opt, tmp_path: Path) -> None:
    steps = 6
    lrs = _torch_warmup_cosine(steps, warmup=2, peak=0.05)
    assert len(set(lrs)) == steps  # the schedule really changes every step
    m = check_equivalent(
        _lr_recipe(make_opt), tmp_path, steps=steps, schedule=lambda i: lrs[i], name=kind
    )
    prog = m.entries["train"].programs[0]
    assert [i.name for i in prog.inputs if i.kind is InputKind.HYPERPARAMETER] == ["lr"]
    assert m.hyperparameters[0].name == "lr"


def test_two_param_groups_get_two_lr_inputs(tmp_path: Path) -> None:
    def make_opt(params):
        params = list(params)
        return torch.optim.AdamW(
            [{"params": params[:2]}, {"params": params[2:], "lr": 0.005}],
            lr=0.02,
            capturable=True,
            foreach=False,
        )

    path = tmp_path / "g.stepbundle"
    export(_lr_recipe(make_opt)(), path)
    from stepbundle.runtime import load

    t = load(path, options=LoadOptions(compile=CompileOptions(cache_dir=False)))
    assert t.hyperparameters == {
        "param_groups.0.lr": pytest.approx(0.02),
        "param_groups.1.lr": pytest.approx(0.005),
    }
    t.set_hyperparameter("lr", 0.001)  # the bare key sets every group
    assert list(t.hyperparameters.values()) == [pytest.approx(0.001)] * 2


def test_undeclared_hyperparameter_key_is_refused() -> None:
    r = _lr_recipe(lambda p: torch.optim.SGD(p, lr=0.1), hyper=("learning_rate",))()
    with pytest.raises(
        ExportError,
        match=r"Hyperparameter 'learning_rate' is not a key of the optimizer's param_groups\[0\]",
    ):
        export(r, "/nonexistent/never-written.stepbundle")


# ------------------------------------------------------------ refusals
def test_non_capturable_adam_is_traced_capturable_and_said_so(tmp_path) -> None:
    """#39 item 4: a non-capturable AdamW's step count would be a host number baked into
    the trace (it was refused); the exporter traces it with capturable=True, says so, and
    leaves the user's optimizer as it was."""
    r = _lr_recipe(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=False), hyper=())()
    lines: list[str] = []
    report = export(r, tmp_path / "x.stepbundle", progress=lines.append)
    assert any("AdamW was built with capturable=False" in line for line in lines), lines
    assert all(g["capturable"] is False for g in r.optimizer.param_groups)
    step = next(s for s in report.manifest.state if s.name == "optimizer.state.0.weight.step")
    assert step.spec.shape == ()  # a state tensor of the program, not a baked number


def test_undeclared_schedule_is_refused_naming_lr() -> None:
    def recipe() -> Recipe:
        r = _lr_recipe(lambda p: torch.optim.SGD(p, lr=0.1), hyper=())()
        sched = torch.optim.lr_scheduler.StepLR(r.optimizer, step_size=1, gamma=0.5)

        def step(model, optimizer, batch):
            out = mse_step(model, optimizer, batch)
            sched.step()
            return out

        r.step = step
        return r

    with pytest.raises(ExportError) as err:
        export(recipe(), "/nonexistent/x.stepbundle")
    msg = str(err.value)
    assert "It is the optimizer's param_groups[0]['lr'], which changed from 0.1 to 0.05" in msg
    assert "Recipe(hyperparameters=('lr',))" in msg
    assert "-0.1 in step 1, -0.05 in step 2" in msg


def test_step_dependent_control_flow_is_refused() -> None:
    calls = {"n": 0}

    def step(model, optimizer, batch):
        calls["n"] += 1
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        if calls["n"] % 2 == 0:  # Python control flow on a step counter
            loss = loss * 2
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    r = linear_sgd_recipe(step)
    with pytest.raises(
        ExportError,
        match="The graph of the training step changed between two consecutive traced steps",
    ) as err:
        export(r, "/nonexistent/x.stepbundle")
    assert "What changed:" in str(err.value)


def test_host_read_inside_the_step_is_refused() -> None:
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        if loss.item() > 100:  # reads the device on the host
            loss = loss * 0
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    r = linear_sgd_recipe(step)
    with pytest.raises(
        ExportError,
        match=r"read a device value on the host at \S*test_export_inputs\.py:\d+ "
        r"\(`if loss\.item\(\) > 100:  # reads the device on the host`\), through Tensor\.item",
    ):
        export(r, "/nonexistent/x.stepbundle")


def test_data_dependent_shapes_are_refused() -> None:
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        out = model(batch["x"])
        picked = out[torch.nonzero(out > 0, as_tuple=True)]  # shape depends on the data
        loss = picked.sum() + out.mean()
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    r = linear_sgd_recipe(step)
    with pytest.raises(ExportError) as err:
        export(r, "/nonexistent/x.stepbundle")
    assert "nonzero" in str(err.value) or "read a device value on the host" in str(err.value)


@pytest.mark.parametrize(
    "result, expect",
    [
        (
            lambda loss: {"loss": loss.item()},
            r"return tensors as metrics instead of calling \.item\(\)",
        ),
        (lambda loss: {"loss": 1.0}, "metrics must be tensors on the XLA device"),
        (lambda loss: {"error": loss}, 'a training step must return "loss"'),
        (lambda loss: loss, "it must return a dict of name -> tensor"),
    ],
)
def test_bad_step_results_are_refused(result, expect: str) -> None:
    def step(model, optimizer, batch):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        return result(loss)

    r = linear_sgd_recipe(step)
    with pytest.raises(ExportError, match=expect):
        export(r, "/nonexistent/x.stepbundle")


def test_export_error_is_a_bundle_error() -> None:
    assert issubclass(ExportError, BundleError)


def test_schedule_values_really_reach_the_graph(tmp_path: Path) -> None:
    # With lr forced to 0 by the runtime, SGD's weights stay exactly where they were.
    # (Capturable AdamW refuses an lr of exactly 0: its update computes 0/0 there.)
    r = _lr_recipe(lambda p: torch.optim.SGD(p, lr=0.05))
    path = tmp_path / "z.stepbundle"
    export(r(), path)
    got = run_bundle_inprocess(path, make_batches(r(), 2), 2, schedule=lambda i: 0.0)
    init = {k: v.numpy() for k, v in r().model.state_dict().items()}
    for k, v in init.items():
        assert math.isclose(float(abs(got.state[k] - v).max()), 0.0, abs_tol=0.0), k


def test_spmd_mode_is_refused_with_the_data_parallel_alternative(tmp_path: Path) -> None:
    """xr.use_spmd() is process-wide and cannot be undone, so this runs in a child."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "os.environ['PJRT_DEVICE'] = 'CPU'\n"
        "import torch, torch_xla.runtime as xr\n"
        "xr.use_spmd()\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        f"sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
        "from export_helpers import linear_sgd_recipe, mse_step\n"
        "from stepbundle.exporter import ExportError, export\n"
        "try:\n"
        f"    export(linear_sgd_recipe(mse_step), {str(tmp_path / 'b.stepbundle')!r})\n"
        "except ExportError as e:\n"
        "    print('REFUSED', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "SPMD mode" in out.stdout and "--devices N" in out.stdout
    assert not (tmp_path / "b.stepbundle").exists()
