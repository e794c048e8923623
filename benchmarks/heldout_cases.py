"""Held-out training steps (issue #15's list): recipes nobody in this repository tuned for.

Every case is a function ``make(drop: bool) -> Recipe`` that seeds torch itself, so two
calls give the same initial state. ``drop=False`` sets every dropout and stochastic-depth
probability to 0: the variant PyTorch float64 on the CPU can be compared with (its
random numbers are not torch_xla's).

Imports: torch, torchvision, transformers; timm and peft only in the cases using them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SEED = 2024


def classify(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
    import torch

    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def lm_step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face causal/masked LM: the model computes its own loss from ``labels``."""
    optimizer.zero_grad()
    loss = model(input_ids=batch["ids"], labels=batch["ids"]).loss
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def bert_step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
    optimizer.zero_grad()
    out = model(input_ids=batch["ids"], attention_mask=batch["mask"], labels=batch["y"])
    out.loss.backward()
    optimizer.step()
    return {"loss": out.loss}


def t5_step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
    optimizer.zero_grad()
    loss = model(input_ids=batch["ids"], labels=batch["labels"]).loss
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def autocast_step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
    import torch

    optimizer.zero_grad()
    with torch.autocast(device_type=batch["x"].device.type, dtype=torch.bfloat16):
        logits = model(batch["x"])
    loss = torch.nn.functional.cross_entropy(logits.float(), batch["y"])
    loss.backward()
    optimizer.step()
    return {"loss": loss}


def _nodrop(model: Any) -> None:
    """Every dropout-like module's probability to 0 (torch, torchvision, timm)."""
    import torch

    for m in model.modules():
        if (
            isinstance(m, torch.nn.modules.dropout._DropoutNd)
            or type(m).__name__ == "StochasticDepth"
        ):
            m.p = 0.0
        elif type(m).__name__ == "DropPath":
            m.drop_prob = 0.0


def _images(n: int, size: int, classes: int = 10) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    return {"x": torch.randn(n, 3, size, size, generator=g), "y": torch.arange(n) % classes}


def _tokens(n: int, t: int, vocab: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (n, t), generator=g)


def _recipe(model: Any, opt: Any, step: Any, batch: dict[str, Any], drop: bool) -> Any:
    from stepbundle.exporter import Recipe

    if not drop:
        _nodrop(model)
    return Recipe(model=model, optimizer=opt, step=step, example_batch=batch, seed=SEED)


def _sgd(model: Any) -> Any:
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _adamw(model: Any, lr: float = 1e-3) -> Any:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, capturable=True, foreach=False)


def mobilenet_v3_small(drop: bool) -> Any:
    import torch
    import torchvision

    torch.manual_seed(0)
    m = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10)
    return _recipe(m, _sgd(m), classify, _images(4, 32), drop)


def efficientnet_b0(drop: bool) -> Any:
    import torch
    import torchvision

    torch.manual_seed(0)
    m = torchvision.models.efficientnet_b0(weights=None, num_classes=10)
    # Batch 8 at 64x64, as for timm resnet10t: at batch 2, 32x32 the last stage's BatchNorm
    # normalized 2 values per channel and even the first loss differed between PyTorch
    # float32 (9.52) and float64 (4.26).
    return _recipe(m, _sgd(m), classify, _images(8, 64), drop)


def torchvision_vit(drop: bool) -> Any:
    import torch
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    m = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        dropout=0.1, attention_dropout=0.1, num_classes=10,
    )  # fmt: skip
    return _recipe(m, _adamw(m), classify, _images(4, 32), drop)


def gpt2_tiny(drop: bool) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        attn_implementation="eager",
    )  # fmt: skip
    m = transformers.GPT2LMHeadModel(cfg)
    m.train()
    return _recipe(m, _adamw(m), lm_step, {"ids": _tokens(2, 16, 64)}, drop)


def t5_tiny(drop: bool) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    m = transformers.T5ForConditionalGeneration(cfg)
    m.train()
    batch = {"ids": _tokens(2, 12, 64), "labels": _tokens(2, 8, 64)}
    return _recipe(m, _adamw(m), t5_step, batch, drop)


def _bert(attn: str | None, drop: bool) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    kw = {} if attn is None else {"attn_implementation": attn}
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3, **kw,
    )  # fmt: skip
    m = transformers.BertForSequenceClassification(cfg)
    m.train()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    batch = {"ids": _tokens(2, 12, 64), "mask": mask, "y": torch.tensor([0, 2])}
    return _recipe(m, _adamw(m), bert_step, batch, drop)


def bert_sdpa(drop: bool) -> Any:
    return _bert(None, drop)


def bert_eager(drop: bool) -> Any:
    return _bert("eager", drop)


def transformer_encoder(drop: bool) -> Any:
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True)
            self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(32, 10)

        def forward(self, x: Any) -> Any:
            return self.head(self.enc(x).mean(1))

    torch.manual_seed(0)
    m = Net()
    g = torch.Generator().manual_seed(7)
    batch = {"x": torch.randn(4, 8, 32, generator=g), "y": torch.arange(4) % 10}
    return _recipe(m, _adamw(m), classify, batch, drop)


def _timm(name: str, size: int, drop: bool, batch: int = 2, **kw: Any) -> Any:
    import timm
    import torch

    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, num_classes=10, **kw)
    return _recipe(m, _sgd(m), classify, _images(batch, size), drop)


def timm_resnet10t(drop: bool) -> Any:
    # Batch 8 at 64x64: layer4's BatchNorm normalizes 32 values per channel (batch 2 at
    # 32x32 left 2, ill-conditioned in any float32: PyTorch's own float32 is far from float64).
    return _timm("resnet10t", 64, drop, batch=8)


def timm_convnext_atto(drop: bool) -> Any:
    return _timm("convnext_atto", 32, drop, drop_path_rate=0.1)


def timm_vit_tiny(drop: bool) -> Any:
    return _timm("vit_tiny_patch16_224", 32, drop, img_size=32, drop_path_rate=0.1)


def _mlp_batch() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(7)
    return {"x": torch.randn(8, 16, generator=g), "y": torch.arange(8) % 4}


def lora_by_hand(drop: bool) -> Any:
    import torch

    class LoraLinear(torch.nn.Module):
        def __init__(self, d_in: int, d_out: int, r: int = 4) -> None:
            super().__init__()
            self.base = torch.nn.Linear(d_in, d_out)
            self.base.requires_grad_(False)
            self.a = torch.nn.Parameter(torch.randn(r, d_in) * 0.1)
            self.b = torch.nn.Parameter(torch.zeros(d_out, r))
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x: Any) -> Any:
            return self.base(x) + self.drop(x) @ self.a.t() @ self.b.t() * 2.0

    torch.manual_seed(0)
    m = torch.nn.Sequential(LoraLinear(16, 32), torch.nn.ReLU(), LoraLinear(32, 4))
    return _recipe(m, _adamw(m, 1e-2), classify, _mlp_batch(), drop)


def peft_lora(drop: bool) -> Any:
    import peft
    import torch

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("fc1", torch.nn.Linear(16, 32))
    base.add_module("act", torch.nn.ReLU())
    base.add_module("fc2", torch.nn.Linear(32, 4))
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["fc1", "fc2"])
    m = peft.get_peft_model(base, cfg)
    # LoRA's B starts at zero: give it values so A's gradient is not exactly zero.
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return _recipe(m, _adamw(m, 1e-2), classify, _mlp_batch(), drop)


def lstm(drop: bool) -> Any:
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(8, 16, num_layers=2, batch_first=True, dropout=0.1)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x: Any) -> Any:
            return self.head(self.rnn(x)[0][:, -1])

    torch.manual_seed(0)
    m = Net()
    g = torch.Generator().manual_seed(7)
    batch = {"x": torch.randn(4, 6, 8, generator=g), "y": torch.arange(4) % 4}
    if not drop:
        m.rnn.dropout = 0.0
    return _recipe(m, _adamw(m, 1e-2), classify, batch, drop)


def _mlp() -> Any:
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)
    )


def bf16_autocast(drop: bool) -> Any:
    import torch

    torch.manual_seed(0)
    m = _mlp()
    return _recipe(m, _adamw(m, 1e-2), autocast_step, _mlp_batch(), drop)


def xla_checkpoint(drop: bool) -> Any:
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = torch.nn.Linear(16, 32)
            self.seg = torch.nn.Sequential(
                torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1)
            )
            self.out = torch.nn.Linear(32, 4)

        def forward(self, x: Any) -> Any:
            import torch_xla.utils.checkpoint as xcp

            return self.out(xcp.checkpoint(self.seg, self.pre(x), use_reentrant=True))

    torch.manual_seed(0)
    m = Net()
    return _recipe(m, _sgd(m), classify, _mlp_batch(), drop)


def frozen_batchnorm(drop: bool) -> Any:
    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(8, 10),
    )
    with torch.no_grad():  # running statistics that are not the defaults
        for bn in (m[1], m[4]):
            bn.running_mean.normal_(0, 0.1)
            bn.running_var.uniform_(0.5, 1.5)
    m[1].eval()  # frozen: eval mode, no gradient
    m[1].requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    return _recipe(m, opt, classify, _images(4, 16), drop)


def _opt_case(make_opt: Callable[[Any], Any]) -> Callable[[bool], Any]:
    def make(drop: bool) -> Any:
        import torch

        torch.manual_seed(0)
        m = _mlp()
        return _recipe(m, make_opt(m.parameters()), classify, _mlp_batch(), drop)

    return make


def _rmsprop(p: Any) -> Any:
    import torch

    return torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, capturable=True, foreach=False)


def _nadam(p: Any) -> Any:
    import torch

    return torch.optim.NAdam(p, lr=1e-2, capturable=True, foreach=False)


def _adagrad(p: Any) -> Any:
    import torch

    return torch.optim.Adagrad(p, lr=1e-2, foreach=False)


CASES: dict[str, Callable[[bool], Any]] = {
    "torchvision mobilenet_v3_small": mobilenet_v3_small,
    "torchvision efficientnet_b0 (stochastic depth)": efficientnet_b0,
    "torchvision ViT (2 layers)": torchvision_vit,
    "HF GPT-2 (tiny)": gpt2_tiny,
    "HF T5 (tiny)": t5_tiny,
    "HF BERT (tiny, default sdpa)": bert_sdpa,
    "HF BERT (tiny, eager attention)": bert_eager,
    "nn.TransformerEncoder": transformer_encoder,
    "timm resnet10t": timm_resnet10t,
    "timm convnext_atto": timm_convnext_atto,
    "timm vit_tiny_patch16_224 (32x32)": timm_vit_tiny,
    "LoRA by hand": lora_by_hand,
    "peft LoRA": peft_lora,
    "LSTM (2 layers)": lstm,
    "bf16 autocast": bf16_autocast,
    "torch_xla.utils.checkpoint (dropout inside)": xla_checkpoint,
    "frozen BatchNorm": frozen_batchnorm,
    "RMSprop (momentum)": _opt_case(_rmsprop),
    "NAdam": _opt_case(_nadam),
    "Adagrad": _opt_case(_adagrad),
}

# Cases where float64 means nothing (bf16) or torch_xla's checkpoint needs XLA tensors.
NO_FLOAT64 = {"bf16 autocast", "torch_xla.utils.checkpoint (dropout inside)"}
