"""The ``stepbundle`` command: export, run, inspect, verify.

``run``, ``inspect`` and ``verify`` work without torch; ``export`` imports the exporter
(torch, torch_xla) only when it is called.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _die(msg: str, code: int = 2) -> int:
    print(f"stepbundle: error: {msg}", file=sys.stderr)
    return code


# ------------------------------------------------------------------- export
def _load_recipe(spec: str) -> Any:
    file, sep, func = spec.rpartition(":")
    if not sep or not file or not func:
        raise SystemExit(_die(f"expected FILE.py:FUNC, got {spec!r}"))
    path = Path(file)
    if not path.is_file():
        raise SystemExit(_die(f"recipe file {file!r} does not exist"))
    module_name = f"_stepbundle_recipe_{path.stem}"
    mod_spec = importlib.util.spec_from_file_location(module_name, path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.parent.resolve()))
    mod_spec.loader.exec_module(module)
    fn = getattr(module, func, None)
    if fn is None or not callable(fn):
        raise SystemExit(_die(f"{file} has no function {func!r}"))
    return fn


def cmd_export(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
        import torch_xla  # noqa: F401
    except ImportError as e:
        return _die(
            f"`stepbundle export` needs torch and torch_xla ({e}). Install the export extra: "
            "pip install 'stepbundle[export]'. Running bundles (`stepbundle run`) does not."
        )
    from stepbundle.exporter import ExportError, Recipe, export
    from stepbundle.exporter.workspace import xla_device

    t0 = time.perf_counter()
    # Create the XLA device before the recipe runs any CPU autograd (torch_xla asserts
    # in autograd's engine otherwise).
    xla_device()
    fn = _load_recipe(args.recipe)
    recipe = fn()
    if not isinstance(recipe, Recipe):
        return _die(
            f"{args.recipe} returned {type(recipe).__name__}, not a stepbundle.exporter.Recipe"
        )
    print(f"[export] recipe built in {time.perf_counter() - t0:.2f}s", file=sys.stderr)

    def progress(msg: str) -> None:
        print(f"[export] {msg}", file=sys.stderr)

    try:
        report = export(recipe, args.output, mlir_dir=args.emit_mlir, progress=progress)
    except ExportError as e:
        return _die(str(e), 1)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(report.input_counts.items()))
    stages = ", ".join(f"{k} {v:.2f}s" for k, v in report.stage_seconds.items())
    print(f"[export] train inputs: {counts}", file=sys.stderr)
    print(f"[export] stages: {stages}; total {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    print(f"{report.path}\t{report.size} bytes\t{report.digest}")
    return 0


# ---------------------------------------------------------------------- run
class _Progress:
    """A one-line progress display for terminals: step, rate, loss."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, i: int, metrics: dict[str, Any], force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        rate = (i + 1) / max(now - self.t0, 1e-9)
        loss = float(metrics["loss"]) if "loss" in metrics else float("nan")
        width = 30
        filled = int(width * (i + 1) / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r[{bar}] {i + 1}/{self.total} {rate:8.1f} steps/s loss {loss:.6g}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def _scalar(v: Any) -> Any:
    import numpy as np

    a = np.asarray(v)
    if a.size == 1:
        x = a.reshape(()).item()
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        return x
    return a.tolist()


def _devices_arg(text: str) -> int | str:
    if text == "all":
        return "all"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 device, got {n}")
    return n


def _join_job(args: argparse.Namespace) -> bool:
    """Set up devices before jax starts: virtual CPU devices, and the multi-process job.

    Returns whether this process joined a multi-process job.
    """
    from stepbundle.runtime import distributed

    multi = args.distributed or args.coordinator is not None
    if not multi and (args.num_processes is not None or args.process_id is not None):
        raise ValueError("--num-processes and --process-id need --coordinator HOST:PORT")
    cpu_devices = None
    platform = args.device.partition(":")[0].lower()
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    if platform == "cpu" and isinstance(args.devices, int) and args.devices > 1 and not forced:
        processes = args.num_processes or 1
        cpu_devices = -(-args.devices // processes)
    if multi and args.devices == 1:
        raise ValueError(
            "A multi-process job runs one data-parallel program over its devices: pass "
            "--devices all (or a number that covers every process's devices)."
        )
    if multi:
        distributed.initialize(
            args.coordinator, args.num_processes, args.process_id, cpu_devices=cpu_devices
        )
    elif cpu_devices is not None:
        distributed.set_cpu_devices(cpu_devices)
    return multi


# How long the processes of a job wait for each other to load (cold compiles included).
_SETUP_TIMEOUT_S = 1800.0


def cmd_run(args: argparse.Namespace) -> int:
    import numpy as np

    from stepbundle.runtime import distributed, load
    from stepbundle.runtime.errors import NonFiniteLossError
    from stepbundle.runtime.schedule import parse_schedule
    from stepbundle.runtime.trainer import iter_batches
    from stepbundle.schema.errors import BundleError

    cache: Any = False if args.no_cache else (args.cache_dir or True)
    try:
        joined = _join_job(args)
    except (BundleError, ValueError) as e:
        return _die(str(e), 1)

    def fail(message: str, code: int) -> int:
        # In a job, tell the other processes, which would otherwise wait for this one
        # in their first step.
        if joined:
            with contextlib.suppress(BundleError):
                distributed.agree(False, timeout_s=_SETUP_TIMEOUT_S)
        return _die(message, code)

    try:
        with np.load(args.data, allow_pickle=False) as npz:
            data = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as e:
        return fail(f"cannot read --data {args.data!r}: {e}", 2)
    try:
        t0 = time.perf_counter()
        trainer = load(
            args.bundle,
            device=args.device,
            # An evaluation run compiles only its entry (the training buckets need not
            # split over the devices then).
            entry=None if args.entry == "train" else args.entry,
            cache_dir=cache,
            expect_digest=args.expect_digest,
            stop_on_nonfinite=args.stop_on_nonfinite,
            devices=args.devices,
            pack_state=args.pack_state,
            shard_optimizer_state=args.shard_optimizer_state,
        )
        load_s = time.perf_counter() - t0
        batches = iter_batches(data)
        if args.resume:
            trainer.load_checkpoint(args.resume)
        if args.seed is not None:
            trainer.seed = args.seed
        for spec in args.lr_schedule or []:
            name, eq, rest = (
                spec.partition("=") if "=" in spec.split(":", 1)[0] else ("lr", "", spec)
            )
            trainer.set_schedule(name, parse_schedule(rest))
        for spec in args.set or []:
            name, _, value = spec.partition("=")
            trainer.set_hyperparameter(name, float(value))
    except (BundleError, ValueError) as e:
        return fail(str(e), 1)
    try:
        if joined and not distributed.agree(True, timeout_s=_SETUP_TIMEOUT_S):
            return _die("another process of the job failed to start; its error says why", 1)
    except BundleError as e:
        return _die(str(e), 1)
    hits = trainer.load_info.cache_hits
    n_dev = len(trainer.devices)
    print(
        f"[run] loaded {args.bundle} in {load_s:.2f}s ({trainer.load_info.compiled} compiled, "
        f"{hits} from cache) on {args.device}"
        + (f" x{n_dev} (data parallel)" if n_dev > 1 else ""),
        file=sys.stderr,
    )
    # In a multi-process job process 0 reports; every process computes.
    writer = trainer.placement.writes_files
    json_out = args.json
    progress = _Progress(args.steps) if (not json_out and sys.stderr.isatty()) else None
    start_step = trainer.step_count
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.checkpoint_every and ckpt_dir is None:
        return _die("--checkpoint-every needs --checkpoint-dir")
    stdout = sys.stdout

    if args.entry != "train":
        try:
            for i in range(args.steps):
                m = trainer.evaluate(
                    batches[i % len(batches)], entry=args.entry
                )  # no state: no offset
                line = json.dumps({"step": i, **{k: _scalar(v) for k, v in m.items()}})
                if writer:
                    stdout.write(line + "\n")
        except BundleError as e:
            return _die(str(e), 1)
        return 0

    def on_step(i: int, metrics: dict[str, Any]) -> None:
        step = start_step + i
        if not writer:  # process 0 of a multi-process job reports for all
            pass
        elif json_out:
            stdout.write(
                json.dumps({"step": step, **{k: _scalar(v) for k, v in metrics.items()}}) + "\n"
            )
        elif progress is not None:
            progress.update(i, metrics, force=i + 1 == args.steps)
        elif (i + 1) % max(1, args.steps // 10) == 0 or i == 0:
            loss = metrics.get("loss")
            stdout.write(
                f"step {step:6d}  loss {float(loss) if loss is not None else float('nan'):.6f}\n"
            )
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            assert ckpt_dir is not None
            trainer.save_checkpoint(ckpt_dir / f"step-{step + 1:08d}.safetensors")

    t1 = time.perf_counter()
    code = 0
    try:
        trainer.run(batches, args.steps, on_step=on_step, offset=start_step, keep_metrics=False)
    except NonFiniteLossError as e:
        print(f"\n[run] {e}", file=sys.stderr)
        if ckpt_dir is not None:
            trainer.save_checkpoint(
                ckpt_dir / f"step-{trainer.step_count:08d}-before-nonfinite.safetensors"
            )
        code = 3
    except BundleError as e:
        return _die(str(e), 1)
    trainer.block_until_ready()
    elapsed = time.perf_counter() - t1
    if progress is not None:
        progress.close()
    done = trainer.step_count - start_step
    print(
        f"[run] {done} steps in {elapsed:.2f}s ({done / max(elapsed, 1e-9):.1f} steps/s)",
        file=sys.stderr,
    )
    if args.save_state:
        from stepbundle.runtime.checkpoint import write_safetensors

        state = trainer.state_dict()  # every process takes part in gathering it
        if writer:
            write_safetensors(args.save_state, state)
            print(f"[run] wrote state to {args.save_state}", file=sys.stderr)
    return code


# ------------------------------------------------------------ inspect, verify
def _nbytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _describe(bundle: Any) -> dict[str, Any]:
    from stepbundle.schema.codec import manifest_to_wire

    m = bundle.manifest
    wire = manifest_to_wire(m)
    return {
        "digest": bundle.digest,
        "path": os.fspath(bundle.path),
        "file_size": bundle.file_size,
        "format_version": list(bundle.version),
        **wire,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    from stepbundle.schema import open_bundle
    from stepbundle.schema.errors import BundleError
    from stepbundle.schema.manifest import StateUpdateOutput

    try:
        bundle = open_bundle(args.bundle)
    except BundleError as e:
        return _die(str(e), 1)
    with bundle:
        if args.json:
            print(json.dumps(_describe(bundle), indent=2))
            return 0
        m = bundle.manifest
        out = [
            f"bundle    {bundle.path}",
            f"digest    {bundle.digest}",
            f"format    {bundle.version[0]}.{bundle.version[1]}   size {_nbytes(bundle.file_size)}",
            f"producer  stepbundle {m.producer.stepbundle}, torch {m.producer.torch}, "
            f"torch_xla {m.producer.torch_xla}, jax {m.producer.jax}",
        ]
        if m.required_features:
            out.append(f"requires  {', '.join(m.required_features)}")
        if m.rng is not None:
            out.append(f"rng       seed {m.rng.seed} ({m.rng.rule})")
        for h in m.hyperparameters:
            out.append(f"hyper     {h.name} = {h.value!r} ({h.spec})")
        for name, entry in m.entries.items():
            out.append("")
            out.append(
                f"entry {name!r}: {len(entry.programs)} program(s), "
                + ("updates state" if entry.updates_state else "read-only")
            )
            for i, p in enumerate(entry.programs):
                batch = ", ".join(f"{b.name}: {b.spec}" for b in p.batch)
                out.append(
                    f"  program {i}: batch {{{batch}}}  StableHLO {p.stablehlo_version}  section {p.section}"
                )
                out.append(f"    inputs ({len(p.inputs)}):")
                for j, inp in enumerate(p.inputs):
                    label = getattr(inp, "name", "rng_seed")
                    out.append(f"      {j:4d}  {inp.kind.value:16s} {label:48s} {inp.spec}")
                out.append(f"    outputs ({len(p.outputs)}):")
                for j, o in enumerate(p.outputs):
                    if isinstance(o, StateUpdateOutput):
                        alias = (
                            f"donates input {o.donates}"
                            if o.donates is not None
                            else "no input to donate"
                        )
                        out.append(
                            f"      {j:4d}  state_update     {o.state:48s} {o.spec}  {alias}"
                        )
                    else:
                        out.append(f"      {j:4d}  metric           {o.name:48s} {o.spec}")
        out.append("")
        total = 0
        out.append(f"state ({len(m.state)} tensors):")
        for s in m.state:
            total += s.spec.nbytes
            flag = "trainable" if s.trainable else ""
            alias = f"  aka {', '.join(s.aliases)}" if s.aliases else ""
            out.append(
                f"  {s.kind.value:16s} {s.name:52s} {str(s.spec):20s} {_nbytes(s.spec.nbytes):>10s} {flag}{alias}"
            )
        out.append(f"  total {_nbytes(total)}")
        out.append("")
        out.append(f"sections ({len(m.sections)}):")
        for sec in m.sections:
            out.append(
                f"  {sec.kind.value:8s} {sec.name:52s} {sec.length:>10d} B  sha256:{sec.sha256[:16]}…"
            )
        print("\n".join(out))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from stepbundle.schema import open_bundle
    from stepbundle.schema.errors import BundleError

    try:
        bundle = open_bundle(args.bundle)
    except BundleError as e:
        print(f"FAILED {args.bundle}: {e}")
        return 1
    with bundle:
        failures = bundle.verify()
        if failures:
            for f in failures:
                print(f"FAILED {f}")
            return 1
        print(f"OK {args.bundle} {bundle.digest} ({len(bundle.manifest.sections)} sections)")
    return 0


# --------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from stepbundle import __version__

    p = argparse.ArgumentParser(prog="stepbundle", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"stepbundle {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser(
        "export", help="trace a recipe's training step and write a bundle (needs torch)"
    )
    e.add_argument("recipe", help="FILE.py:FUNC returning a stepbundle.exporter.Recipe")
    e.add_argument("-o", "--output", required=True, help="bundle file to write")
    e.add_argument(
        "--emit-mlir", metavar="DIR", help="also write each program as .mlir text into DIR"
    )
    e.set_defaults(fn=cmd_export)

    r = sub.add_parser("run", help="run a bundle's steps (no torch needed)")
    r.add_argument("bundle")
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--data", required=True, help=".npz with one (S, *shape) array per batch input")
    r.add_argument(
        "--entry", default="train", help="entry to run (train, or a read-only entry such as eval)"
    )
    r.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    r.add_argument("--save-state", metavar="OUT.safetensors", help="write the final state")
    r.add_argument("--checkpoint-every", type=int, default=0, metavar="K")
    r.add_argument("--checkpoint-dir", metavar="D")
    r.add_argument("--resume", metavar="CKPT", help="restore a checkpoint before the first step")
    r.add_argument(
        "--lr-schedule",
        action="append",
        metavar="[NAME=]SPEC",
        help="e.g. warmup_cosine:peak=1e-3,warmup=100,total=10000 (NAME defaults to lr)",
    )
    r.add_argument("--set", action="append", metavar="NAME=VALUE", help="set a hyperparameter")
    r.add_argument("--seed", type=int, help="RNG seed of the first step")
    r.add_argument("--device", default="cpu", help="cpu, cuda, rocm or tpu (optionally :index)")
    r.add_argument(
        "--devices",
        type=_devices_arg,
        default=1,
        metavar="N|all",
        help="data-parallel over the first N devices of the job, or all of them (the batch "
        "is split over them, the state replicated)",
    )
    r.add_argument(
        "--shard-optimizer-state",
        action="store_true",
        help="with several devices, split optimizer state over them (ZeRO-1)",
    )
    r.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="join a multi-process job whose process 0 listens here (jax.distributed)",
    )
    r.add_argument("--num-processes", type=int, metavar="P", help="processes in the job")
    r.add_argument("--process-id", type=int, metavar="I", help="this process's rank, 0..P-1")
    r.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process job found from the environment (TPU pods, SLURM, Open MPI)",
    )
    r.add_argument("--expect-digest", metavar="sha256:...", help="refuse any other bundle")
    r.add_argument(
        "--stop-on-nonfinite", action="store_true", help="stop before a non-finite loss is applied"
    )
    r.add_argument(
        "--pack-state",
        type=int,
        default=True,
        metavar="N",
        help="hold state tensors of up to N elements in one buffer per dtype (default 65536; 0: off)",
    )
    r.add_argument("--cache-dir", help="compilation cache folder (default ~/.cache/stepbundle)")
    r.add_argument("--no-cache", action="store_true", help="do not use the compilation cache")
    r.set_defaults(fn=cmd_run)

    i = sub.add_parser("inspect", help="show a bundle's entries, bindings, state and digests")
    i.add_argument("bundle")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_inspect)

    v = sub.add_parser("verify", help="check every digest of a bundle")
    v.add_argument("bundle")
    v.set_defaults(fn=cmd_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
