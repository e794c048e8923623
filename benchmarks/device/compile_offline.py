"""Compile a bundle's programs for a TPU v5e on a machine without one.

    pip install "jax[tpu]==0.10.2"      # brings the libtpu it pins (0.0.42)
    python benchmarks/device/compile_offline.py BUNDLE --variants eval train --rounds 3

libtpu compiles for a TPU it is not attached to: jax's ``get_topology_desc`` gives
compile-only devices of a ``v5e:2x2`` slice, and the program is compiled for one of them
exactly as the runtime compiles it (its checks, the same rewrite pipeline for platform
"tpu", the same compile options), without loading it. Each variant is one entry of
``compile_variants.py``'s table (a rewrite dropped, swapped or a family of operations
zeroed). Per compile this reports the seconds ``compile`` took and what libtpu logs
(``TPU_VMODULE=deepsea_compiler_backend=3,hlo_pass_pipeline=1``, read from libtpu's
stderr, redirected to a file around each compile): the final count of VLIW bundles of
the machine code, the LLO instructions of its largest kernels, and the HLO passes'
seconds (``compile_passes.py``'s sums).

It reproduced the device's compile times (the CNN's train program with XLA's own
weight-gradient convolutions: 51 s here against 45-61 s on the chip; the eval program
0.8 s against 0.8-1.6 s; ``benchmarks/results/compile_offline-v5e.json``) on a 2-core machine, where the device tool's 30 minutes a session
allow a few calls: a change to a rewrite is measured here first, then on the chip.

Imports: jax (with libtpu), stepbundle.
"""

from __future__ import annotations

import os

# libtpu reads these when it loads; without a TPU it has no metadata server to ask.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_VMODULE", "deepsea_compiler_backend=3,hlo_pass_pipeline=1")
os.environ.setdefault("TPU_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from stepbundle.runtime import _compat
from stepbundle.runtime.compile import rewrites
from stepbundle.runtime.compile.program import compile_program  # noqa: E402
from stepbundle.runtime.entry_compiler import scalar_constants  # noqa: E402
from stepbundle.runtime.load import _open_bundle  # noqa: E402
from stepbundle.runtime.placement.sharding import Placement  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_passes import summarize  # noqa: E402
from compile_variants import variants  # noqa: E402

_BUNDLES = re.compile(r"final program bundle count: ([\d,]+)")
_LLO = re.compile(r"\] \[(.*)\] LLO optimizing ([\d,]+) instructions")


def _parse_log(text: str, top: int) -> dict[str, Any]:
    kernels = sorted(
        ((int(n.replace(",", "")), name) for name, n in _LLO.findall(text)), reverse=True
    )
    counts = [int(n.replace(",", "")) for n in _BUNDLES.findall(text)]
    passes = summarize(["[compile_variants] this round 0", *text.splitlines()], top=4)
    return {
        "hlo_pass_seconds": passes[0]["pass_seconds"] if passes else None,
        "top_hlo_passes": passes[0]["top_passes"] if passes else [],
        "bundles": counts[-1] if counts else None,
        "llo_instructions": sum(n for n, _ in kernels),
        "largest_kernels": [[name, n] for n, name in kernels[:top]],
    }


class _CompileOnly:
    """``compile_program``'s cache, for a compile-only device: compiles, loads nothing."""

    def compile(
        self, label: str, client: Any, bytecode: bytes, devices: Any, options: Any
    ) -> tuple[Any, None]:
        from jax._src.interpreters import mlir as jax_mlir
        from jax._src.lib.mlir import ir

        with jax_mlir.make_ir_context():
            exe = client.compile(
                ir.Module.parse(bytecode),
                executable_devices=_compat.xla_client.DeviceList(tuple(devices)),
                compile_options=options,
            )
        return exe, None


def compile_one(
    client: Any, device: Any, bundle: Any, entry: str, pipeline: Any, options: dict[str, Any]
) -> Any:
    """Compile ``entry``'s first program for platform "tpu" through the runtime's own
    ``compile_program`` (its checks, ``pipeline`` as the rewrite table, its compile
    options), not loaded: there is no device to load it on."""
    ent = bundle.manifest.entries[entry]
    program = ent.programs[0]
    original, rewrites.REWRITES = rewrites.REWRITES, pipeline
    try:
        return compile_program(
            client,
            Placement([device]),
            bundle.section(program.section),
            program,
            where=entry,
            label=entry,
            donate=ent.updates_state,
            cache=_CompileOnly(),  # type: ignore[arg-type]
            matmul_precision=options.get("matmul_precision"),
            scalar_constants=scalar_constants(bundle, program),
        ).executable
    finally:
        rewrites.REWRITES = original


class _Stderr:
    """fd 2 (where libtpu logs) sent to a temporary file while in the block; ``text``
    holds what was written."""

    def __enter__(self) -> _Stderr:
        self._file = tempfile.TemporaryFile("w+")
        sys.stderr.flush()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read()
        self._file.close()


def _libtpu_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def main() -> int:
    table = variants()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="variants (compile_variants.py's table): " + ", ".join(table),
    )
    p.add_argument("bundle")
    p.add_argument("--variants", nargs="*", default=["eval", "train"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--top", type=int, default=8, help="largest kernels listed per compile")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    unknown = [v for v in a.variants if v not in table]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {sorted(table)}")
    with _Stderr() as init:  # libtpu's start-up lines; shown only if it fails
        try:
            device = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
        except Exception:
            failed = True
        else:
            failed = False
    if failed:
        sys.stderr.write(init.text)
        raise SystemExit("libtpu could not describe a v5e: is libtpu installed (jax[tpu])?")
    device = device.devices[0]
    bundle = _open_bundle(a.bundle, None)
    rows: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for name in a.variants:
            entry, pipeline, options = table[name]
            with _Stderr() as log:
                t0 = time.perf_counter()
                compile_one(device.client, device, bundle, entry, pipeline, options)
                seconds = time.perf_counter() - t0
            row = {"variant": name, "round": r, "compile_s": seconds}
            row.update(_parse_log(log.text, a.top))
            rows.append(row)
            print(
                f"round {r} {name:28s} {seconds:6.2f} s  bundles {row['bundles']}  "
                f"LLO {row['llo_instructions']}",
                flush=True,
            )
    report = {
        "bundle": a.bundle,
        "jax": jax.__version__,
        "libtpu": _libtpu_version(),
        "target": "TPU v5e, compile-only (libtpu without a chip)",
        "host_cpus": os.cpu_count(),
        "rows": rows,
    }
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
