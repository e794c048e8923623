"""Bundles without weights (``Recipe(include_state=False)``), started from a checkpoint.

The done-when case: a Hugging Face model (tiny config, random init) saved with
``save_pretrained`` into several shards starts a bundle exported without state; its first
5 steps equal the same recipe exported with state bit for bit, and torch_xla eager from
that checkpoint within the equivalence suite's bounds for fp32 (``FP32_XLA``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import Run, make_batches, train_eager_xla

from stepbundle.exporter import Recipe, export
from stepbundle.exporter.workspace import StateTensor, Workspace, xla_device
from stepbundle.frontend.initial_state import initial_section, non_persistent_buffers
from stepbundle.schema import SectionKind, StateKind, open_bundle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "equivalence"))
from equiv_models import FP32_XLA, METRIC_FLOOR  # noqa: E402

STEPS = 5


def _llama(checkpoint: Path | None, seed: int = 0) -> Recipe:
    """The tiny Llama of the equivalence suite (tied embeddings), from ``checkpoint`` or
    from a random init of ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    if checkpoint is None:
        model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM.from_pretrained(checkpoint, attn_implementation="eager")
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, weight_decay=0.01, capturable=True, foreach=False
    )

    def step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
        optimizer.zero_grad()
        out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        out.loss.backward()
        optimizer.step()
        return {"loss": out.loss}

    g = torch.Generator().manual_seed(9)
    return Recipe(
        model=model,
        optimizer=opt,
        step=step,
        example_batch={"input_ids": torch.randint(0, 96, (2, 16), generator=g)},
    )


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("hf")
    ckpt = d / "checkpoint"
    _llama(None, seed=8).model.save_pretrained(ckpt, safe_serialization=True, max_shard_size="40KB")
    free = d / "free.stepbundle"
    full = d / "full.stepbundle"
    # Exported from another random init: nothing of these weights may reach the run.
    export(Recipe(**{**vars(_llama(None, seed=1)), "include_state": False}), free)
    export(_llama(ckpt), full)
    return {"ckpt": ckpt, "free": free, "full": full}


def test_the_checkpoint_is_sharded_and_drops_the_tied_weight(hf: dict[str, Any]) -> None:
    index = json.loads((hf["ckpt"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert "lm_head.weight" not in index["weight_map"]  # HF saves one of a tied pair
    with open_bundle(hf["free"]) as b:
        entry = b.manifest.state_entry("model.embed_tokens.weight")
        assert entry.aliases == ("lm_head.weight",)


def test_a_weights_free_bundle_is_its_programs_and_tables(hf: dict[str, Any]) -> None:
    with open_bundle(hf["free"]) as free, open_bundle(hf["full"]) as full:
        kinds = {s.name: s.kind for s in free.manifest.sections}
        origin = {s.name: kinds[s.section] for s in free.manifest.state}
        assert free.manifest.required_features == ("state_initializers",)
        assert not full.manifest.required_features
        stored = sum(s.length for s in free.manifest.sections if s.kind is SectionKind.TENSOR)
        assert stored < 1024  # rotary inv_freq: a non-persistent buffer, in no checkpoint
        assert free.file_size < full.file_size / 4
    params = [s.name for s in free.manifest.state if s.kind.value == "parameter"]
    assert params and all(origin[n] is SectionKind.EXTERNAL for n in params)
    assert origin["model.rotary_emb.inv_freq"] is SectionKind.TENSOR
    moments = [n for n in origin if n.startswith("optimizer.state.")]
    assert moments and all(origin[n] is SectionKind.FILL for n in moments)


def test_five_steps_from_the_shards_equal_the_full_bundle_and_eager(hf: dict[str, Any]) -> None:
    recipe = _llama(hf["ckpt"])
    batches = make_batches(recipe, 3, seed=5)
    free = _run(hf["free"], batches, init_from=hf["ckpt"])
    full = _run(hf["full"], batches)  # the same programs: a compile cache hit
    # Bit for bit: the same programs from the same initial state.
    assert [m["loss"] for m in free.metrics] == [m["loss"] for m in full.metrics]
    assert sorted(free.state) == sorted(full.state)
    for k, v in full.state.items():
        assert free.state[k].tobytes() == v.tobytes(), k
    # torch_xla eager from that checkpoint, at the equivalence suite's fp32 bounds.
    eager = train_eager_xla(lambda: _llama(hf["ckpt"]), batches, STEPS)
    for got, ref in zip(free.metrics, eager.metrics):
        rel = abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), METRIC_FLOOR)
        assert rel <= FP32_XLA.metric_rtol, (got, ref)
    for k, ref in eager.state.items():
        if k.endswith(".grad") and k not in free.state:
            continue  # zero_grad() drops them each step: not state of the bundle
        bound, why = FP32_XLA.state_bound(k)
        got = free.state[k].astype(np.float64)
        err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        assert err <= bound, (k, err, why)


def _run(bundle: Path, batches: list[Any], **kwargs: Any) -> Run:
    from stepbundle.runtime import LoadOptions, load

    t = load(bundle, options=LoadOptions.from_keywords(**kwargs))
    ms = t.run(list(batches), STEPS)
    metrics = [{k: float(np.asarray(v).reshape(-1)[0]) for k, v in m.items()} for m in ms]
    return Run(metrics, t.state_dict())


# ------------------------------------------------ which state is described by rule


class _WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
        self.register_buffer("scale", torch.full((3,), 0.5), persistent=False)
        self.register_buffer("positions", torch.arange(3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) * self.scale + self.positions + self.frozen


def _optimizers() -> dict[str, Any]:
    import torch_xla.amp.syncfree as sf

    return {
        "adam_amsgrad": lambda p: torch.optim.Adam(
            p, lr=0.01, amsgrad=True, capturable=True, foreach=False
        ),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, capturable=True, foreach=False),
        "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "syncfree_adamw": lambda p: sf.AdamW(p, lr=0.01),
        "syncfree_sgd": lambda p: sf.SGD(p, lr=0.1, momentum=0.9),
    }


@pytest.mark.parametrize(
    "kind", ["adam_amsgrad", "adamw", "sgd_momentum", "syncfree_adamw", "syncfree_sgd"]
)
def test_a_fresh_optimizer_is_described_by_rule(kind: str) -> None:
    torch.manual_seed(0)
    model = _WithBuffers()
    opt = _optimizers()[kind]([p for p in model.parameters() if p.requires_grad])
    recipe = Recipe(model, opt, lambda m, o, b: {}, {"x": torch.zeros(4, 5)})
    non_persistent = non_persistent_buffers(model)
    assert non_persistent == {"scale", "positions"}
    with Workspace(recipe, xla_device()) as ws:
        tensors = ws.state_tensors()
        sections = {
            s.name: initial_section(s, s.tensor, include_state=False, non_persistent=non_persistent)
            for s in tensors
        }
        values = {s.name: s.tensor.detach().cpu() for s in tensors}
    kinds = {n: k for n, (k, _) in sections.items()}
    for name in ("lin.weight", "lin.bias", "bn.weight", "frozen", "bn.running_var"):
        assert kinds[name] is SectionKind.EXTERNAL, name  # in every checkpoint
    assert kinds["bn.num_batches_tracked"] is SectionKind.EXTERNAL
    assert kinds["scale"] is SectionKind.FILL  # non-persistent, one value
    assert kinds["positions"] is SectionKind.TENSOR  # non-persistent, in no checkpoint
    optimizer = {n for n in kinds if n.startswith("optimizer.state.")}
    expected_keys = {
        "adam_amsgrad": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
        "adamw": {"step", "exp_avg", "exp_avg_sq"},
        "sgd_momentum": {"momentum_buffer"},
        "syncfree_adamw": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
        "syncfree_sgd": {"step", "momentum_buffer"},
    }[kind]
    assert {n.rsplit(".", 1)[1] for n in optimizer} == expected_keys
    grads = {n for n in kinds if n.endswith(".grad")}
    assert grads == {"lin.weight.grad", "lin.bias.grad", "bn.weight.grad", "bn.bias.grad"}
    for name in optimizer | grads:
        assert kinds[name] is SectionKind.FILL, name
        # The rule is exact: the element, repeated, is what the bundle would have stored.
        value = values[name]
        element = torch.frombuffer(bytearray(sections[name][1]), dtype=value.dtype)
        assert torch.equal(element.reshape(()).expand(value.shape), value), name
        assert not bool(value.ne(0).any()), name  # a fresh optimizer starts at zero


def test_state_of_an_optimizer_that_stepped_is_required() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.nn.functional.mse_loss(model(torch.randn(4, 5)), torch.randn(4, 3)).backward()
    opt.step()
    state = opt.state[model.weight]

    def section(key: str) -> tuple[SectionKind, bytes]:
        s = StateTensor(
            f"optimizer.state.weight.{key}", StateKind.OPTIMIZER_STATE, state[key], False
        )
        return initial_section(s, state[key], include_state=False, non_persistent=set())

    assert section("exp_avg")[0] is SectionKind.EXTERNAL  # only a runtime checkpoint has it
    kind, data = section("step")  # one number: the value itself, exactly
    assert kind is SectionKind.FILL and np.frombuffer(data, np.float32).tolist() == [1.0]


# ------------------------------------------------------------------------ the CLI


def test_the_cli_exports_without_state_runs_from_a_file_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    from stepbundle.cli.main import main

    example = Path(__file__).resolve().parents[2] / "examples" / "linear_adamw.py"
    sys.path.insert(0, str(example.parent))
    from linear_adamw import data, recipe

    free, full = tmp_path / "free.stepbundle", tmp_path / "full.stepbundle"
    assert main(["export", f"{example}:recipe", "-o", str(free), "--no-state"]) == 0
    assert main(["export", f"{example}:recipe", "-o", str(full)]) == 0
    weights = tmp_path / "weights.safetensors"
    save_file(dict(recipe().model.state_dict()), weights)  # what a PyTorch user has
    npz = tmp_path / "data.npz"
    np.savez(npz, **data())
    capsys.readouterr()

    assert main(["inspect", str(free)]) == 0
    summary = capsys.readouterr().out.splitlines()
    assert "requires  state_initializers" in summary
    origin = next(line for line in summary if line.startswith("initial "))
    # Linear(5, 3): weight and bias (15 + 3 f32) from a file; AdamW step, exp_avg, exp_avg_sq
    # of each by rule.
    assert "0 stored (0 B), 6 by rule, 2 from a checkpoint (72 B; run with --init-from" in origin
    assert main(["inspect", str(free), "--full"]) == 0
    shown = capsys.readouterr().out.splitlines()
    row = {line.split()[1]: line for line in shown if line.startswith("  parameter ")}
    assert "from file  trainable" in row["weight"]
    state = {
        line.split()[1]: line.split() for line in shown if line.startswith("  optimizer_state ")
    }
    assert state["optimizer.state.weight.exp_avg"][-1] == "zeros"
    assert "  total 224 B, 0 B of it stored in the bundle" in shown

    def run(bundle: Path, *extra: str) -> tuple[int, list[float], str]:
        code = main(["run", str(bundle), "--data", str(npz), "--json", "--no-cache", *extra])
        out = capsys.readouterr()
        return code, [json.loads(line)["loss"] for line in out.out.splitlines()], out.err

    code, _, err = run(free, "--steps", "2")
    assert code == 1 and "it was exported without state" in err
    code, want, _ = run(full, "--steps", "4")
    assert code == 0 and len(want) == 4
    ckpt = tmp_path / "step2.safetensors"
    code, got, err = run(
        free, "--steps", "2", "--init-from", str(weights), "--save-state", str(ckpt)
    )
    assert code == 0 and got == want[:2]
    assert f"[run] initial state: 2 from {weights}, 6 by rule, 0 stored" in err
    # --resume needs no --init-from: the checkpoint holds every state tensor.
    code, got, _ = run(free, "--steps", "2", "--resume", str(ckpt))
    assert code == 0 and got == want[2:]


def test_a_weights_free_export_keeps_no_host_copy_of_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #40: the writer reads only the dtype and shape of a weights-free bundle's
    parameters and persistent buffers, so the exporter hands it meta tensors for them
    (CPU copies of the whole state ran a 117M Llama out of a 12 GB address space); the
    state stored by rule or by value (optimizer state, non-persistent buffers) is still
    read from real values, and the bundle is unchanged."""
    export_module = sys.modules["stepbundle.exporter.export"]  # the package's export() hides it
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("table", torch.arange(3.0), persistent=False)
    recipe = Recipe(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True, foreach=False),
        step=lambda m, o, b: _mse(m, o, b),
        example_batch={"x": torch.randn(8, 5), "y": torch.randn(8, 4)},
        include_state=False,
    )
    seen: dict[str, torch.Tensor] = {}
    real = export_module.write_bundle

    def spy(recipe: Recipe, path: Any, *, state: Any, **kw: Any) -> Any:
        seen.update({s.name: v for s, v in state})
        return real(recipe, path, state=state, **kw)

    monkeypatch.setattr(export_module, "write_bundle", spy)
    export(recipe, tmp_path / "free.stepbundle", check=False)
    assert seen["0.weight"].is_meta and seen["1.running_mean"].is_meta
    assert seen["0.weight"].shape == (4, 5)
    assert not seen["table"].is_meta and seen["table"].tolist() == [0.0, 1.0, 2.0]
    assert not seen["optimizer.state.0.weight.exp_avg"].is_meta
    with open_bundle(tmp_path / "free.stepbundle") as b:
        kinds = {e.name: b.manifest.section(e.section).kind for e in b.manifest.state}
    assert kinds["0.weight"] is SectionKind.EXTERNAL
    assert kinds["table"] is SectionKind.TENSOR
    assert kinds["optimizer.state.0.weight.exp_avg"] is SectionKind.FILL


def _mse(model: Any, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]) + model.table.sum() * 0, batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _square_step(model: Any, optimizer: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    optimizer.zero_grad()
    loss = model(batch["x"]).square().mean()
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def test_a_meta_device_model_is_refused_with_the_way_out() -> None:
    # torch_xla copies the state to its device to trace: a model built on meta (for a
    # weights-free export) gets a typed refusal naming the torch front-end, not a
    # "Cannot copy out of meta tensor" traceback.
    from stepbundle.frontend.errors import MetaTensorError

    with torch.device("meta"):
        model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    batch = {"x": torch.ones(3, 4)}
    recipe = Recipe(
        model=model, optimizer=opt, step=_square_step, example_batch=batch, include_state=False
    )
    with pytest.raises(MetaTensorError, match="--frontend torch") as e:
        export(recipe, "/nonexistent/never-written.stepbundle")
    assert "'weight'" in str(e.value)


def test_meta_optimizer_state_of_a_real_model_is_refused_with_the_way_out() -> None:
    # a real model whose optimizer state was left on meta: the workspace would copy it to
    # the device ("Cannot copy out of meta tensor"); refused by name first
    from stepbundle.frontend.errors import MetaTensorError

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, capturable=True, foreach=False)
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.zeros((), device="meta"),
            "exp_avg": torch.empty_like(p, device="meta"),
            "exp_avg_sq": torch.empty_like(p, device="meta"),
        }

    recipe = Recipe(
        model=model, optimizer=opt, step=_square_step, example_batch={"x": torch.ones(3, 4)}
    )
    with pytest.raises(MetaTensorError, match="--frontend torch") as e:
        export(recipe, "/nonexistent/never-written.stepbundle")
    assert "'optimizer.state.weight.step'" in str(e.value)
