"""Activation checkpointing through the torch front-end: what it saves on a v5e, offline.

    # 1. the bundles (torch front-end, .venv-torch): each model without checkpointing,
    #    with torch.utils.checkpoint as the front-end now exports it, and as it exported
    #    it before frontend_torch/remat.py (the recomputation left for XLA to merge)
    .venv-torch/bin/python benchmarks/device/activation_checkpointing.py export /tmp/ac
    # 2. each train program compiled for one v5e chip without the chip (jax with libtpu)
    python benchmarks/device/activation_checkpointing.py compile /tmp/ac

Models: a residual MLP (8 blocks of 512 -> 2048 -> 512, GELU, batch 4096, AdamW, float32),
segments checkpointed with ``use_reentrant=False`` and with the reentrant kind; and
``benchmarks/llama.py``'s ``llama117m`` (12 layers, width 768, context 1024, batch 8,
bf16 autocast, AdamW), each layer checkpointed (``use_reentrant=False``). Per program,
XLA's memory analysis of the chip (``get_compiled_memory_stats``: temporaries, arguments)
from ``runtime/offline.compile_offline`` (load's compile options, one device of a
``v5e:2x2`` topology). Written to ``benchmarks/results/activation_checkpointing-v5e.md``.

XLA's CPU backend removes optimization barriers before its other passes, so on a CPU the
recomputation is merged into the forward whatever the program says: this needs libtpu.

Imports: torch and the torch front-end (export); jax with libtpu (compile).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "activation_checkpointing-v5e.md"
VARIANTS = ("none", "checkpointed", "before")


def _mlp(kind: str, reentrant: bool) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from stepbundle.frontend import Recipe

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(512, 2048), nn.Linear(2048, 512)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.b(F.gelu(self.a(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.head = nn.Linear(512, 512), nn.Linear(512, 10)
            self.blocks = nn.ModuleList([Block() for _ in range(8)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for block in self.blocks:
                x = block(x) if kind == "none" else checkpoint(block, x, use_reentrant=reentrant)
            return self.head(x)

    def step(model: Any, opt: Any, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        opt.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        return {"loss": loss}

    torch.manual_seed(0)
    model = Net().to("meta")
    batch = {"x": torch.randn(4096, 512), "y": torch.randint(0, 10, (4096,))}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Recipe(model=model, optimizer=opt, step=step, example_batch=batch,
                  include_state=False)  # fmt: skip


def _llama(kind: str) -> Any:
    sys.path.insert(0, str(HERE.parent))
    import llama

    cfg = dataclasses.replace(llama.SIZES["llama117m"], checkpointed=kind != "none")
    return llama.recipe(cfg)


@contextlib.contextmanager
def _as_before() -> Any:
    """The front-end as it was before remat.py: the recomputation traced as it runs."""
    from stepbundle.export_torch import capture

    saved = capture.recompute_behind_barriers
    capture.recompute_behind_barriers = lambda: contextlib.nullcontext([0])  # type: ignore
    try:
        yield
    finally:
        capture.recompute_behind_barriers = saved


def export(folder: str) -> None:
    from stepbundle.export_torch import export as export_bundle

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cases = [(f"mlp-{v}", lambda v=v: _mlp(v, False), v) for v in VARIANTS]
    cases.append(("mlp-reentrant-checkpointed", lambda: _mlp("ckpt", True), "checkpointed"))
    cases += [(f"llama117m-{v}", lambda v=v: _llama(v), v) for v in VARIANTS]
    for name, make, variant in cases:
        t0 = time.perf_counter()
        with _as_before() if variant == "before" else contextlib.nullcontext():
            export_bundle(make(), out / f"{name}.stepbundle", check=False)
        print(f"{name}: exported in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def compile_all(folder: str, out: str) -> None:
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    from jax.experimental import topologies

    from stepbundle.runtime import CompileOptions, LoadOptions
    from stepbundle.runtime.offline import compile_offline

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[:1]
    rows = []
    for path in sorted(Path(folder).glob("*.stepbundle")):
        t0 = time.perf_counter()
        # the program as written, not the load's output-head choice (head_choice.py)
        written = LoadOptions(compile=CompileOptions(head_barriers=False))
        stats = compile_offline(path, devices, written).executables["train[0]"]
        mem = stats.get_compiled_memory_stats()
        row = {
            "bundle": path.stem,
            "temporaries_mib": mem.temp_size_in_bytes / 2**20,
            "arguments_mib": mem.argument_size_in_bytes / 2**20,
            "compile_s": time.perf_counter() - t0,
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    by = {r["bundle"]: r for r in rows}
    lines = [
        "Activation checkpointing through the torch front-end, compiled for one v5e chip "
        f"without it (libtpu, jax {jax.__version__}; benchmarks/device/activation_"
        "checkpointing.py). XLA's memory analysis of the train program: temporaries "
        "(activations and scratch) and arguments (the state and the batch). 'none': no "
        "checkpointing; 'checkpointed': torch.utils.checkpoint as the front-end exports it "
        "now (frontend_torch/remat.py); 'before': as it exported it before (the "
        "recomputation traced as it ran, merged back into the forward by XLA).",
        "",
        "| model | none | before | checkpointed | checkpointed / none | arguments |",
        "|---|---|---|---|---|---|",
    ]
    for model, ckpt in (("mlp", "mlp-checkpointed"), ("mlp (reentrant)", "mlp-reentrant-"
                        "checkpointed"), ("llama117m", "llama117m-checkpointed")):  # fmt: skip
        stem = model.split(" ")[0]
        none, new = by.get(f"{stem}-none"), by.get(ckpt)
        before = by.get(ckpt.replace("checkpointed", "before"))  # the same kind, before
        if none is None or new is None:
            continue
        b = f"{before['temporaries_mib']:.1f} MiB" if before else "-"
        lines.append(
            f"| {model} | {none['temporaries_mib']:.1f} MiB | {b} | "
            f"{new['temporaries_mib']:.1f} MiB | "
            f"{new['temporaries_mib'] / none['temporaries_mib']:.2f} | "
            f"{none['arguments_mib']:.1f} MiB |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    Path(out).write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("folder")
    c = sub.add_parser("compile")
    c.add_argument("folder")
    c.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.cmd == "export":
        export(a.folder)
    else:
        compile_all(a.folder, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
