"""The 55M GPT of gpt.py with its attention written three ways, through both front-ends.

    # here: weights-free bundles (0.2 MB each), one per form and front-end
    .venv/bin/python benchmarks/device/sdpa_forms.py export -o build/tpu/sdpa --frontend torch_xla
    .venv-torch/bin/python benchmarks/device/sdpa_forms.py export -o build/tpu/sdpa --frontend torch
    # on the device machine (no torch): every bundle of the folder, side by side
    python benchmarks/device/sdpa_forms.py bench build/tpu/sdpa --out sdpa_forms.json [--unfused]

Forms (``Block.forward`` of benchmarks/models.py, everything else as gpt.py):

- ``forward_mask``: ``softmax(q @ k.T * scale, masked_fill(~tril))`` with the mask made
  in ``forward`` (what ``stablehlo/attention.py`` matches in torch_xla's programs);
- ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``;
- ``sdpa_mask``: the same with a causal boolean ``attn_mask`` made in ``forward`` (what
  Hugging Face's models pass when traced).

``bench`` loads each bundle at the default matmul precision (the torch front-end records
PyTorch's "highest"; the fused kernels run only at "default"), starts it from gpt.py's
initial state, and times the steps in alternating rounds. It reports per bundle: ms per
step, MFU (gpt.py's count), the first loss, how many attentions were fused per program
(``load_info.fused_attention``) and the runtime's warnings about attention it kept.

Imports: numpy; jax for ``bench``; torch and a front-end for ``export``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import gpt  # noqa: E402  (the model's sizes, initial state, batches and FLOP count)

from stepbundle.runtime import CompileOptions, LoadOptions, StateOptions  # noqa: E402

FORMS = ("forward_mask", "sdpa", "sdpa_mask")


# ------------------------------------------------------------------ export (torch)
def _forward(form: str) -> Any:
    import torch
    import torch.nn.functional as F
    from models import GELU

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.heads
        q, k, v = (
            a.view(b, t, h, c // h).transpose(1, 2) for a in self.qkv(self.ln1(x)).split(c, 2)
        )
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if form == "forward_mask":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
            y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        elif form == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)), approximate=GELU)))

    return forward


def export_all(out: Path, frontend: str, forms: tuple[str, ...] = FORMS) -> None:
    import models
    import torch

    if frontend == "torch_xla":
        from stepbundle.exporter import export
    else:
        from stepbundle.export_torch import export
    from stepbundle.frontend.recipe import Recipe

    def step(model: Any, optimizer: Any, batch: dict[str, Any]) -> dict[str, Any]:
        # gpt.py's step: bf16 autocast, AdamW (capturable), the gradient norm clipped
        optimizer.zero_grad()
        with torch.autocast(device_type=batch["idx"].device.type, dtype=torch.bfloat16):
            logits = model(batch["idx"])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, gpt.VOCAB), batch["target"].reshape(-1)
        )
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), gpt.CLIP)
        optimizer.step()
        return {"loss": loss, "grad_norm": grad_norm}

    out.mkdir(parents=True, exist_ok=True)
    original = models.Block.forward
    for form in forms:
        models.Block.forward = _forward(form)  # type: ignore[method-assign]
        try:
            torch.manual_seed(0)
            cfg = models.GPTConfig(
                vocab=gpt.VOCAB, block=gpt.BLOCK, layers=gpt.LAYERS, width=gpt.WIDTH,
                heads=gpt.HEADS, dropout=0.0, batch=gpt.BATCH,
            )  # fmt: skip
            model = models.SmallGPT(cfg)
            opt = torch.optim.AdamW(
                model.parameters(), lr=gpt.LR, weight_decay=gpt.WEIGHT_DECAY,
                capturable=True, foreach=False,
            )  # fmt: skip
            tokens = torch.randint(0, gpt.VOCAB, (gpt.BATCH, gpt.BLOCK + 1))
            recipe = Recipe(
                model=model,
                optimizer=opt,
                step=step,
                include_state=False,
                example_batch={
                    "idx": tokens[:, :-1].contiguous(),
                    "target": tokens[:, 1:].contiguous(),
                },
            )
            path = out / f"{form}-{frontend}.stepbundle"
            t0 = time.perf_counter()
            report = export(recipe, path)
            print(f"{path}: {report.size} bytes, {time.perf_counter() - t0:.0f} s", flush=True)
        finally:
            models.Block.forward = original  # type: ignore[method-assign]


# ------------------------------------------------------------------ bench (device)
def bench(args: argparse.Namespace) -> int:
    import jax

    from stepbundle.runtime import load
    from stepbundle.runtime.state.checkpoint import write_safetensors

    platform = args.platform or jax.default_backend()
    init = Path(args.workdir) / "gpt55m-init.safetensors"
    init.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(init, gpt.initial_state())
    data = gpt.batches(args.batches)
    bundles = sorted(Path(args.folder).glob("*.stepbundle"))
    out: dict[str, Any] = {"jax": jax.__version__, "device": str(jax.devices(platform)[0])}
    trainers: dict[str, Any] = {}
    runs = [(p, p.name.removesuffix(".stepbundle"), True) for p in bundles]
    if args.unfused:  # each bundle also as traced (--no-fused-attention)
        runs += [(p, p.name.removesuffix(".stepbundle") + "+unfused", False) for p in bundles]
    for path, name, fused in runs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            try:
                trainers[name] = load(
                    path,
                    device=platform,
                    options=LoadOptions(
                        compile=CompileOptions(
                            cache_dir=False,
                            matmul_precision=args.precision,
                            fused_attention=fused,
                        ),
                        state=StateOptions(init_from=init),
                    ),
                )
            except Exception as e:  # recorded, not fatal
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                print(f"{name}: {out[name]['error']}", flush=True)
                continue
        info = trainers[name].load_info
        out[name] = {
            "load_s": time.perf_counter() - t0,
            "compile_s": info.seconds.get("compile"),
            "fused_attention": info.fused_attention,
            "warnings": [str(w.message)[:300] for w in caught if "attention" in str(w.message)],
        }
        out[name]["first_loss"] = float(trainers[name].step(data[0])["loss"])
        print(f"{name}: {json.dumps(out[name])}", flush=True)

    def time_steps(trainer: Any, n: int) -> float:
        t0 = time.perf_counter()
        m = None
        for i in range(n):
            m = trainer.step(data[i % len(data)])
        float(m["loss"])  # type: ignore[index]
        return (time.perf_counter() - t0) / n * 1e3

    for t in trainers.values():
        time_steps(t, 3)
    samples: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(args.rounds):
        for name, t in trainers.items():
            samples[name].append(time_steps(t, args.steps))
    for name, s in samples.items():
        ms = float(np.median(s))
        mfu = gpt.step_flops() / (ms / 1e3) / (args.peak_tflops * 1e12)
        out[name].update(ms_per_step=ms, mfu=mfu, samples_ms=s)
        fused = sum(out[name]["fused_attention"].values())
        print(f"{name:28s} {ms:8.2f} ms/step  MFU {mfu:.1%}  fused {fused}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("-o", "--output", required=True, help="a folder")
    e.add_argument("--frontend", choices=("torch_xla", "torch"), required=True)
    e.add_argument("--forms", default=",".join(FORMS), help="a comma-separated subset")
    b = sub.add_parser("bench")
    b.add_argument("folder")
    b.add_argument("--platform", default=None)
    b.add_argument("--precision", default="default")
    b.add_argument("--workdir", default="/tmp/sdpa_forms")
    b.add_argument("--batches", type=int, default=4)
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--rounds", type=int, default=5)
    b.add_argument("--peak-tflops", type=float, default=197.0)
    b.add_argument("--out", default=None)
    b.add_argument("--unfused", action="store_true", help="also each bundle unfused")
    a = p.parse_args()
    if a.cmd == "export":
        export_all(Path(a.output), a.frontend, tuple(a.forms.split(",")))
        return 0
    return bench(a)


if __name__ == "__main__":
    raise SystemExit(main())
