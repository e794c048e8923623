"""The export check (issue #39 item 2), once per front-end: it passes faithful bundles of
the equivalence suite's kinds of model, and refuses a bundle whose step drops an update.

The planted divergence is real: a bundle exported unchecked is rewritten so that one
state tensor's new value becomes an unused metric, and the runtime then never updates
that tensor; the check must name it, with both values.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_here import cli_here
from torch import nn

from stepbundle.frontend.errors import ExportError
from stepbundle.frontend.recipe import Recipe
from stepbundle.frontend.step_check import CheckFailed, check_bundle
from stepbundle.schema import SectionPayload, open_bundle, write_bundle
from stepbundle.schema.manifest import MetricOutput, StateUpdateOutput


def _mse(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    return {"loss": loss}


def _classify(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    opt.zero_grad()
    logits = model(batch["x"])
    loss = nn.functional.cross_entropy(logits, batch["y"])
    loss.backward()
    opt.step()
    return {"loss": loss, "accuracy": (logits.detach().argmax(-1) == batch["y"]).float().mean()}


def _linear(adam: dict[str, Any]) -> Recipe:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, **adam)
    x = torch.randn(8, 5)
    return Recipe(model, opt, _mse, {"x": x, "y": x @ torch.randn(5, 3) + 0.1})


def _cnn(adam: dict[str, Any]) -> Recipe:
    """The equivalence suite's CNN: convolutions, training BatchNorm, SGD with nesterov."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)  # fmt: skip
    batch = {"x": torch.randn(6, 3, 12, 12), "y": torch.arange(6) % 5}
    return Recipe(model, opt, _classify, batch, seed=1234)


class _TinyLM(nn.Module):
    """nanoGPT's shape, small: tied embeddings, a pre-LN block with causal attention."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.pos = nn.Parameter(torch.randn(8, 16) * 0.02)
        self.ln = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.pos[: idx.shape[1]]
        q, k, v = self.qkv(self.ln(h)).split(16, dim=-1)
        att = (q @ k.transpose(-1, -2)) / 4.0
        mask = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool, device=idx.device).tril()
        h = h + att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.head(h + self.mlp(self.ln(h)))


def _lm_step(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
    opt.zero_grad()
    logits = model(batch["idx"])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
    loss.backward()
    opt.step()
    return {"loss": loss}


def _lm(adam: dict[str, Any]) -> Recipe:
    torch.manual_seed(2)
    model = _TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **adam)
    idx = torch.randint(0, 32, (4, 8))
    return Recipe(model, opt, _lm_step, {"idx": idx, "y": torch.roll(idx, -1, 1)})


@pytest.mark.parametrize("make", [_linear, _cnn, _lm], ids=["linear_adamw", "cnn_bn", "tiny_lm"])
def test_the_check_passes_faithful_bundles(frontend: Any, make: Any, tmp_path: Path) -> None:
    report = frontend.export(make(frontend.adam), tmp_path / "b.stepbundle", check=True)
    check = report.check
    assert check is not None and check.ran, check
    assert check.reference == "PyTorch eager on the CPU"
    n_state = len(report.manifest.state)
    assert check.compared >= n_state  # every state tensor and the metrics
    assert "check" in report.stage_seconds and check.seconds > 0
    assert (tmp_path / "b.stepbundle").exists()


def test_the_check_runs_a_bundle_without_weights_from_its_state_by_rule(
    frontend: Any, tmp_path: Path
) -> None:
    recipe = _linear(frontend.adam)
    recipe.include_state = False
    report = frontend.export(recipe, tmp_path / "b.stepbundle", check=True)
    assert report.check is not None and report.check.ran


def test_check_false_skips_it(frontend: Any, tmp_path: Path) -> None:
    report = frontend.export(_linear(frontend.adam), tmp_path / "b.stepbundle", check=False)
    assert report.check is None and "check" not in report.stage_seconds


def test_the_check_is_on_by_default(
    frontend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STEPBUNDLE_EXPORT_CHECK", raising=False)
    report = frontend.export(_linear(frontend.adam), tmp_path / "b.stepbundle")
    assert report.check is not None and report.check.ran
    monkeypatch.setenv("STEPBUNDLE_EXPORT_CHECK", "0")
    report = frontend.export(_linear(frontend.adam), tmp_path / "c.stepbundle")
    assert report.check is None


def _waiting_runtimes() -> list[int]:
    """This process's children that are the check's runtime process started ahead
    (``python -m stepbundle.cli.step_check --wait``), alive or not yet reaped."""
    import os

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"stepbundle.cli.step_check" in cmdline and b"--wait" in cmdline:
            found.append(int(entry.name))
    return found


def test_the_runtime_process_starts_with_the_export_and_ends_with_it(
    frontend: Any, tmp_path: Path
) -> None:
    """The check's runtime process is started before the step is traced (its start runs
    while the export does) and ended when the export fails; an export without the check
    starts none."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads the process table from /proc")
    seen: list[list[int]] = []

    def failing(model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, Any]) -> Any:
        seen.append(_waiting_runtimes())
        raise RuntimeError("the step fails while it is traced")

    recipe = _linear(frontend.adam)
    recipe.step = failing
    with pytest.raises(Exception, match="the step fails while it is traced"):
        frontend.export(recipe, tmp_path / "b.stepbundle", check=True)
    assert seen and len(seen[0]) == 1, seen  # there while the step was traced
    assert _waiting_runtimes() == []  # and gone, reaped, once the export failed
    seen.clear()
    with pytest.raises(Exception, match="the step fails while it is traced"):
        frontend.export(recipe, tmp_path / "c.stepbundle", check=False)
    assert seen and seen[0] == [], seen
    # A check that ran: the process waited for the bundle, then stepped it.
    report = frontend.export(_linear(frontend.adam), tmp_path / "d.stepbundle", check=True)
    assert report.check is not None and report.check.ran
    assert report.check.runtime_parts["wait"] > 0.0
    assert _waiting_runtimes() == []


def test_the_waiting_runtime_process_ends_on_an_empty_input() -> None:
    """An export that ends without handing it a bundle closes its input: it exits, and
    writes nothing."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "stepbundle.cli.step_check", "--wait"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "" and done.stderr == ""
    bad = subprocess.run([sys.executable, "-m", "stepbundle.cli.step_check"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode == 2 and "BUNDLE, BATCH and OUT" in bad.stderr


def _dropping(path: Path, out: Path, state: str) -> Path:
    """The bundle at ``path``, its train program no longer writing ``state`` back (the
    new value becomes a metric nobody reads): the runtime leaves ``state`` as it was."""
    with open_bundle(path) as b:
        manifest = b.manifest
        payloads = [SectionPayload(s.name, s.kind, bytes(b.section(s.name))) for s in manifest.sections]  # fmt: skip

    def edit(o: Any) -> Any:
        if isinstance(o, StateUpdateOutput) and o.state == state:
            return MetricOutput(name="dropped_update", spec=o.spec)
        return o

    train = manifest.entries["train"]
    programs = tuple(dataclasses.replace(p, outputs=tuple(edit(o) for o in p.outputs)) for p in train.programs)  # fmt: skip
    assert programs != train.programs, f"{state} is not updated by the program"
    entries = {**manifest.entries, "train": dataclasses.replace(train, programs=programs)}
    write_bundle(out, dataclasses.replace(manifest, entries=entries), payloads)
    return out


@pytest.mark.parametrize(
    ("make", "state"),
    [
        (_linear, "weight"),
        (_linear, "optimizer.state.weight.exp_avg_sq"),
        (_cnn, "1.running_var"),
        (_lm, "pos"),
    ],
)
def test_the_check_catches_a_dropped_update(
    frontend: Any, make: Any, state: str, tmp_path: Path
) -> None:
    recipe = make(frontend.adam)
    report = frontend.export(recipe, tmp_path / "good.stepbundle", check=False)
    bad = _dropping(report.path, tmp_path / "bad.stepbundle", state)
    with open_bundle(bad) as b:
        manifest = b.manifest
    with pytest.raises(CheckFailed) as caught:
        check_bundle(make(frontend.adam), bad, manifest, random_reference="none")
    e = caught.value
    assert isinstance(e, ExportError)
    assert e.name == state
    assert str(e).count(state) >= 1 and "bundle " in str(e) and "eager " in str(e)
    assert math.isfinite(e.bundle_value) and math.isfinite(e.eager_value)
    assert e.bundle_value != e.eager_value
    assert not bad.exists()  # a refused bundle is not left behind


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_step_that_draws_random_numbers(frontend: Any, tmp_path: Path) -> None:
    """torch_xla: checked against torch_xla eager from the bundle's seed (the same masks);
    torch: against PyTorch on the CPU with the program's draws (jax's threefry from the
    bundle's seed) replayed (``frontend_torch/check.py``)."""
    torch.manual_seed(0)
    model = _Dropout()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = {"x": torch.randn(16, 8), "y": torch.randn(16, 4)}
    recipe = Recipe(model, opt, _mse, batch, seed=7)
    report = frontend.export(recipe, tmp_path / "b.stepbundle", check=True)
    check = report.check
    assert check is not None
    if frontend.name == "torch_xla":
        assert check.ran and check.reference.startswith("torch_xla eager")
    else:
        assert check.ran, check.reason
        assert check.reference.endswith("the bundle's random numbers replayed"), check
        assert check.compared >= len(report.manifest.state)


def test_the_cli_says_the_check_ran_and_skips_it_with_no_check(
    frontend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "STEPBUNDLE_EXPORT_CHECK"}
    # A shell's environment: without the flag torch_xla added when this process imported it.
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if f != "--xla_cpu_enable_fast_math=false"]
    env.update({"XLA_FLAGS": " ".join(flags)} if flags else {})
    env["STEPBUNDLE_CACHE_DIR"] = str(tmp_path / "cache")
    base = [sys.executable, "-m", "stepbundle", "export", "examples/linear_adamw.py:recipe",
            "--frontend", frontend.name]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    on = subprocess.run([*base, "-o", str(tmp_path / "a.stepbundle")], cwd=root, env=env,
                        capture_output=True, text=True, timeout=600)  # fmt: skip
    assert on.returncode == 0, on.stderr[-2000:]
    assert "[export] checked: one step through the runtime on the CPU" in on.stderr
    assert "check " in on.stderr.split("[export] stages:")[1]  # its seconds among the stages
    # The check compiled the train program as a run does, into the compile cache: a load
    # with run's defaults, in a fresh process, finds it there (jaxlib 0.10 on; before,
    # the check compiles fast and leaves the cache alone).
    from stepbundle.cli.step_check import _compile_as_run

    load = ("from stepbundle.runtime import load; import sys; "
            "i = load(sys.argv[1], 'cpu').load_info; print(i.cache_hits, i.compiled)")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", load, str(tmp_path / "a.stepbundle")], cwd=root,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    want = ["1", "0"] if _compile_as_run() else ["0", "1"]  # hits, compiled
    assert run.stdout.split() == want, run.stdout
    # --no-check through the same CLI in this process (stepbundle.cli.main, what the child
    # above ran): a second child would spend its time importing torch and jax again.
    monkeypatch.delenv("STEPBUNDLE_EXPORT_CHECK", raising=False)
    recipe = f"{root / 'examples' / 'linear_adamw.py'}:recipe"
    done = cli_here("export", recipe, "--frontend", frontend.name,
                    "-o", str(tmp_path / "b.stepbundle"), "--no-check")  # fmt: skip
    code, err = done.returncode, done.stderr
    assert code == 0, err[-2000:]
    assert "checked:" not in err and (tmp_path / "b.stepbundle").exists()
    assert "[export] written unchecked (check=False, --no-check" in err  # said, not silent


def test_numerics_torch_xla_is_checked_against_torch_xla_eager(
    frontend: Any, tmp_path: Path
) -> None:
    """A bundle that keeps XLA's BatchNorm is compared with what computes it: torch_xla
    eager (the torch front-end computes PyTorch's numerics only and refuses the setting)."""
    if frontend.name != "torch_xla":
        pytest.skip("numerics='torch_xla' is the torch_xla front-end's setting")
    recipe = _cnn(frontend.adam)
    recipe.numerics = "torch_xla"
    report = frontend.export(recipe, tmp_path / "b.stepbundle", check=True)
    assert report.check is not None and report.check.ran
    assert report.check.reference == "torch_xla eager (numerics='torch_xla')"
    bad = _dropping(report.path, tmp_path / "bad.stepbundle", "1.running_var")
    with open_bundle(bad) as b:
        manifest = b.manifest
    recipe = _cnn(frontend.adam)
    recipe.numerics = "torch_xla"
    from stepbundle.exporter.check import references

    plain, _ = references("torch_xla", 0)
    with pytest.raises(CheckFailed, match="1.running_var"):
        check_bundle(recipe, bad, manifest, reference=plain, random_reference="none")
