"""A step that reads a device value on the host is refused naming the line that did it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from export_helpers import linear_sgd_recipe, mse_step

from stepbundle.exporter import Recipe, export
from stepbundle.exporter.host_reads import HostReadError


def _line_of(fn: object, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return first + offset


def _if_loss_step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    if loss > 0:
        loss.backward()
    optimizer.step()
    return {"loss": loss}


def test_an_if_on_the_loss_names_the_line() -> None:
    with pytest.raises(HostReadError) as err:
        export(linear_sgd_recipe(_if_loss_step), "/nonexistent/x.stepbundle")
    line = _line_of(_if_loss_step, "if loss > 0:")
    assert err.value.location == f"{__file__}:{line}"
    assert err.value.read == "Tensor.__bool__"
    message = str(err.value)
    assert f"test_host_read_refusals.py:{line} (`if loss > 0:`), through Tensor.__bool__" in message
    assert "torch.where instead of `if`" in message


@pytest.mark.parametrize(
    ("read", "name"),
    [
        (lambda t: float(t), "Tensor.__float__"),
        (lambda t: int(t), "Tensor.__int__"),
        (lambda t: t.tolist(), "Tensor.tolist()"),
        (lambda t: [0, 1][t.long()], "Tensor.__index__"),
    ],
    ids=["float", "int", "tolist", "index"],
)
def test_each_kind_of_host_read_is_named(read, name: str) -> None:
    def step(model, optimizer, batch):
        loss = mse_step(model, optimizer, batch)["loss"]
        read((loss > 1e9).float())
        return {"loss": loss}

    with pytest.raises(HostReadError, match=rf"test_host_read_refusals\.py:\d+ .*{name}"):
        export(linear_sgd_recipe(step), "/nonexistent/x.stepbundle")


def test_an_eval_entry_is_guarded_too() -> None:
    r = linear_sgd_recipe(mse_step)
    r.eval_step = lambda model, batch: {
        "n": model(batch["x"]).sum() * 0 + model(batch["x"]).sum().item()
    }
    with pytest.raises(
        HostReadError,
        match=r"The eval step read a device value on the host at \S*test_host_read_refusals\.py",
    ):
        export(r, "/nonexistent/x.stepbundle")


def _bert(attn: str | None) -> Recipe:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **({"attn_implementation": attn} if attn else {}),
    )
    model = BertForSequenceClassification(config)
    model.train()

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        out = model(input_ids=batch["ids"], attention_mask=batch["mask"], labels=batch["labels"])
        out.loss.backward()
        optimizer.step()
        return {"loss": out.loss}

    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, 6:] = 0
    return Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        step=step,
        example_batch={"ids": ids, "mask": mask, "labels": torch.tensor([0, 1, 1, 0])},
    )


def test_hugging_face_sdpa_mask_check_is_named_with_the_fix() -> None:
    from transformers import modeling_attn_mask_utils as utils

    with pytest.raises(HostReadError) as err:
        export(_bert(None), "/nonexistent/x.stepbundle")
    line = _line_of(utils._prepare_4d_attention_mask_for_sdpa, "torch.all(mask == 1)")
    message = str(err.value)
    assert err.value.location == f"transformers/modeling_attn_mask_utils.py:{line}"
    assert f"transformers/modeling_attn_mask_utils.py:{line}" in message
    assert 'attn_implementation="eager"' in message
    assert "transformers/models/bert/modeling_bert.py:" in message  # the frames that called it


def test_hugging_face_bert_with_eager_attention_exports(tmp_path: Path) -> None:
    report = export(_bert("eager"), tmp_path / "bert.stepbundle")
    assert report.manifest.entries["train"].programs[0].inputs


def test_hugging_face_gpt2_with_eager_attention_exports_and_checks(tmp_path: Path) -> None:
    """Its causal mask is made under torch.vmap (transformers/masking_utils.py), whose
    tensors are not functional wrappers either: no dispatch mode is active, so nothing is
    refused, and the export's own check steps the bundle against eager PyTorch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=8,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config)

    def step(model, optimizer, batch):
        optimizer.zero_grad()
        out = model(input_ids=batch["ids"], labels=batch["ids"])
        out.loss.backward()
        optimizer.step()
        return {"loss": out.loss}

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recipe = Recipe(model=model, optimizer=opt, step=step, example_batch={"ids": ids})
    report = export(recipe, tmp_path / "gpt2.stepbundle", check=True)
    assert report.manifest.entries["train"].programs[0].inputs
    assert report.check is not None and report.check.ran, report.check


class _UsersAdamW(torch.optim.AdamW):
    """A user's subclass: the exporter does not take capturable=True for it (torch's own
    non-capturable Adam and AdamW it traces capturable, #39 item 4)."""


def test_a_read_inside_the_optimizer_names_torch_and_the_fix() -> None:
    """A non-capturable AdamW with a declared lr: torch reads the lr tensor as a number."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    r = linear_sgd_recipe(mse_step)
    r.model = model
    r.optimizer = _UsersAdamW(model.parameters(), lr=0.01, foreach=False)
    r.hyperparameters = ("lr",)
    with pytest.raises(HostReadError) as err:
        export(r, "/nonexistent/x.stepbundle")
    message = str(err.value)
    assert "support.py:" in err.value.location  # mse_step's optimizer.step() line
    assert "inside the optimizer's update (torch/optim/" in message
    assert "build the optimizer with capturable=True" in message


def _scalar_read_step(model, optimizer, batch):
    loss = mse_step(model, optimizer, batch)["loss"]
    z = torch.zeros(3, device=loss.device)
    z.addcdiv_(torch.ones_like(z), torch.ones_like(z), value=loss.detach())  # read in C++
    return {"loss": loss + z.sum()}


def test_a_read_in_torchs_cpp_is_named_and_torch_xla_reads_again_afterwards() -> None:
    """torch's C++ reading a tensor as a number is caught by a kernel that stands in for
    torch_xla's while the step is traced (not a TorchDispatchMode: issue #39); torch_xla's
    own kernel is back once the export ends."""
    import torch_xla

    with pytest.raises(HostReadError) as err:
        export(linear_sgd_recipe(_scalar_read_step), "/nonexistent/x.stepbundle")
    line = _line_of(_scalar_read_step, "z.addcdiv_(")
    assert err.value.location == f"{__file__}:{line}"
    assert err.value.read == "aten._local_scalar_dense"
    assert float(torch.full((2,), 1.5, device=torch_xla.device()).sum()) == 3.0


def _dispatch_mode_step(model, optimizer, batch):
    from torch.utils.flop_counter import FlopCounterMode

    optimizer.zero_grad()
    with FlopCounterMode(display=False):
        bias = torch.zeros(3, device=batch["x"].device)
        bias[1] = 10.0
        loss = torch.nn.functional.mse_loss(model(batch["x"]) + bias, batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def test_a_dispatch_mode_inside_the_step_is_refused_naming_the_tensor() -> None:
    """Under a TorchDispatchMode torch_xla's factories make tensors functionalization does
    not track, and torch_xla drops the write into ``bias``: refused, not exported wrong."""
    from stepbundle.exporter.host_reads import UntrackedTensorError

    with pytest.raises(UntrackedTensorError) as err:
        export(linear_sgd_recipe(_dispatch_mode_step), "/nonexistent/x.stepbundle")
    line = _line_of(_dispatch_mode_step, "bias = torch.zeros(")
    assert err.value.location == f"{__file__}:{line}"
    message = str(err.value)
    assert '(`bias = torch.zeros(3, device=batch["x"].device)`), through torch.zeros' in message
    assert "Remove the dispatch mode from the step" in message
