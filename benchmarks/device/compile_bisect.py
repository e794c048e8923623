"""Which part of a program makes the device's compiler slow: compile variants, time each.

    python benchmarks/device/compile_bisect.py BUNDLE [--entry train] [--platform tpu]

Each variant is the entry's program with one family of operations replaced by zeros of
the same type (their operands then feed nothing and XLA drops them), or with a candidate
rewrite applied; every variant is compiled for one device in its own thread, and the
wall seconds of each compile are printed and written as JSON (``--out``). A family whose
removal takes the time away is the cause; a rewrite that keeps the program's meaning and
takes the time away is a fix.

Used on a TPU v5e for issue #28 (examples/cifar_cnn.py's train program: 64 s against its
eval program's 2.3 s). Imports: jax, stepbundle.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax

from stepbundle.runtime import _compat
from stepbundle.schema.reader import open_bundle
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.conv_layout import canonicalize_convolutions
from stepbundle.stablehlo.conv_wgrad import rewrite_weight_gradients
from stepbundle.stablehlo.rng_algorithm import pin_rng_algorithm

_RESULT = re.compile(r"^(\s*)(%[\w#:]+) = (\"?stablehlo\.[a-z_]+\"?)")


def _zero_ops(text: str, op: str, pick: Any = lambda line: True) -> tuple[str, int]:
    """Replace every ``op`` (one result, possibly with a region) by a zero constant."""
    lines = text.split("\n")
    out: list[str] = []
    n = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _RESULT.match(line)
        if m and m.group(3).strip('"') == f"stablehlo.{op}" and pick(line):
            j = i
            depth = 0
            while True:  # the op ends where its braces and parentheses close
                depth += lines[j].count("{") + lines[j].count("(")
                depth -= lines[j].count("}") + lines[j].count(")")
                if depth <= 0 and ("->" in lines[j] or j == i):
                    break  # a one-line op whose type has no "->": `%r = op %a, %b : T`
                j += 1
            sep = "->" if "->" in lines[j] else " : "
            result_type = lines[j].rsplit(sep, 1)[1].strip()
            elem = result_type.rstrip(">").split("<", 1)[-1].rsplit("x", 1)[-1]
            zero = "0.000000e+00" if elem.startswith(("f", "bf")) else "0"
            out.append(
                f"{m.group(1)}{m.group(2)} = stablehlo.constant dense<{zero}> : {result_type}"
            )
            n += 1
            i = j + 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out), n


def _wgrad_feature_first(text: str) -> tuple[str, int]:
    """Weight-gradient convolutions written ``->[0, 1, b, f]`` (HWIO out) as jax writes
    them, ``->[f, b, 0, 1]`` (OIHW out), with a transpose back to the original type."""
    out = []
    n = 0
    for line in text.split("\n"):
        m = re.match(
            r"^(\s*)(%[\w#:]+) = (stablehlo\.convolution.*)->\[0, 1, b, f\](.*)-> tensor<(\d+)x(\d+)x(\d+)x(\d+)x(\w+)>$",
            line,
        )
        if not m:
            out.append(line)
            continue
        ind, name, head, mid, h, w, i, o, et = m.groups()
        tmp = f"%wg{n}"
        out.append(f"{ind}{tmp} = {head}->[f, b, 0, 1]{mid}-> tensor<{o}x{i}x{h}x{w}x{et}>")
        out.append(
            f"{ind}{name} = stablehlo.transpose {tmp}, dims = [2, 3, 1, 0] : "
            f"(tensor<{o}x{i}x{h}x{w}x{et}>) -> tensor<{h}x{w}x{i}x{o}x{et}>"
        )
        n += 1
    return "\n".join(out), n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle")
    p.add_argument("--entry", default="train")
    p.add_argument("--platform", default=None)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    b = open_bundle(a.bundle)
    prog = b.manifest.entries[a.entry].programs[0]
    module = mlir.parse_artifact(b.section(prog.section))
    module.strip_attributes()
    base = module.text()
    variants: dict[str, tuple[str, int]] = {"full": (base, 0)}
    variants["no_wgrad_conv"] = _zero_ops(base, "convolution", lambda s: "[f, b, 0, 1]x" in s)
    variants["no_dgrad_conv"] = _zero_ops(base, "convolution", lambda s: "x[0, 1, o, i]" in s)
    variants["no_select_and_scatter"] = _zero_ops(base, "select_and_scatter")
    variants["no_reduce_window"] = _zero_ops(base, "reduce_window")
    variants["wgrad_feature_first"] = _wgrad_feature_first(base)
    dots = mlir.Module.parse_text(module, base)
    variants["wgrad_as_dots"] = (dots.text(), rewrite_weight_gradients(dots))
    pinned = mlir.Module.parse_text(module, base)
    variants["rng_pinned"] = (pinned.text(), pin_rng_algorithm(pinned))
    both = mlir.Module.parse_text(module, base)
    n = pin_rng_algorithm(both) + rewrite_weight_gradients(both)
    variants["rng_pinned_wgrad_as_dots"] = (both.text(), n)
    canon = mlir.Module.parse_text(module, base)
    variants["canonical_nhwc"] = (canon.text(), canonicalize_convolutions(canon))
    for name in list(b.manifest.entries):
        if name != a.entry:
            other = mlir.parse_artifact(b.section(b.manifest.entries[name].programs[0].section))
            other.strip_attributes()
            variants[f"entry_{name}"] = (other.text(), 0)
    if a.only:
        variants = {k: v for k, v in variants.items() if k in a.only}
    client = _compat.get_client(a.platform or jax.default_backend())
    device = client.local_devices()[0]
    options = _compat.compile_options(1, [device.id])

    # MLIR contexts are not thread-safe: every variant is parsed here, compiled in threads.
    parsed = {
        k: (mlir.Module.parse_text(module, t).bytecode(), n) for k, (t, n) in variants.items()
    }

    def compile_one(item: tuple[str, tuple[bytes, int]]) -> dict[str, Any]:
        name, (bytecode, changed) = item
        t0 = time.perf_counter()
        try:
            _compat.compile_bytecode(client, bytecode, [device], options)
            err = None
        except Exception as e:  # a variant that does not compile is a finding too
            err = f"{type(e).__name__}: {str(e)[:300]}"
        s = time.perf_counter() - t0
        print(f"{name:24s} ops changed {changed:3d}  compile {s:7.2f} s  {err or ''}", flush=True)
        return {"variant": name, "ops_changed": changed, "compile_s": s, "error": err}

    with ThreadPoolExecutor(max_workers=len(variants)) as pool:
        results = list(pool.map(compile_one, parsed.items()))
    report = {
        "bundle": a.bundle,
        "entry": a.entry,
        "jax": jax.__version__,
        "device_kind": device.device_kind,
        "parallel_compiles": len(variants),
        "results": results,
    }
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
