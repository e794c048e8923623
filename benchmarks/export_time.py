"""Export time of real models: the exporter's default (traced steps dropped, never run)
against the old path (every traced step compiled and run, as torch_xla eager would).

Each export runs in a fresh process (torch_xla's in-process compile cache would otherwise
serve the second one), timed from after the imports. Prints a table and writes
benchmarks/results/export_time.md. Usage:

    .venv/bin/python benchmarks/export_time.py [--models resnet18 mobilenet_v3_small ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = ("resnet18", "mobilenet_v3_small", "efficientnet_b0")


def child(name: str, execute: bool, out: str) -> None:
    import torch
    import torchvision

    from stepbundle.exporter import Recipe
    from stepbundle.exporter.export import export_running_traced_steps

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    batch = {"x": torch.randn(4, 3, 64, 64), "y": torch.randint(0, 10, (4,))}

    def step(model, optimizer, batch):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        return {"loss": loss}

    recipe = Recipe(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        step=step,
        example_batch=batch,
    )
    t1 = time.perf_counter()
    rep = export_running_traced_steps(recipe, out, run_traced_steps=execute)
    t2 = time.perf_counter()
    print(json.dumps({"build_s": t1 - t0, "export_s": t2 - t1, "stages_s": rep.stage_seconds}))


def program_texts(path: str) -> list[str]:
    from stepbundle.schema import open_bundle
    from stepbundle.stablehlo.artifact import parse_artifact

    with open_bundle(path) as b:
        secs = [p.section for e in b.manifest.entries.values() for p in e.programs]
        return [parse_artifact(bytes(b.section(s))).text() for s in secs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--out", default=str(HERE / "results" / "export_time.md"))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        name, execute, out = args.child
        child(name, execute == "1", out)
        return
    work = Path("/tmp/stepbundle-export-time")
    work.mkdir(exist_ok=True)
    rows = []
    for name in args.models:
        got = {}
        for execute in (True, False):
            out = str(work / f"{name}-{int(execute)}.stepbundle")
            proc = subprocess.run(
                [sys.executable, __file__, "--child", name, str(int(execute)), out],
                capture_output=True,
                text=True,
                check=True,
            )
            got[execute] = json.loads(proc.stdout.strip().splitlines()[-1])
        same = program_texts(str(work / f"{name}-1.stepbundle")) == program_texts(
            str(work / f"{name}-0.stepbundle")
        )
        old, new = got[True]["export_s"], got[False]["export_s"]
        rows.append((name, old, new, same, got[False]["stages_s"]))
        print(f"{name}: {old:.1f} s -> {new:.1f} s, same programs: {same}", flush=True)
    lines = [
        "# Export time: traced steps dropped vs compiled and run",
        "",
        "`.venv/bin/python benchmarks/export_time.py` (torchvision models, random init, batch 4 of",
        "64x64 images, SGD momentum 0.9; each export in a fresh process, seconds after imports;",
        "a shared 2-core machine). 'same programs': the two bundles' programs print the same",
        "(their debug locations name torch_xla's instruction counters, which differ).",
        "",
        "| model | compiled and run (old) | dropped (default) | speed-up | same programs | stages (default) |",
        "|---|---|---|---|---|---|",
    ]
    for name, old, new, same, stages in rows:
        st = ", ".join(f"{k} {v:.2f} s" for k, v in stages.items())
        lines.append(
            f"| {name} | {old:.1f} s | {new:.1f} s | {old / new:.1f}x | {'yes' if same else 'NO'} | {st} |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
