"""``load(path)``: open a bundle, compile its programs, put its state on the device.

Loading validates the bundle (``stepbundle.schema``), checks each section's digest
before its first use, compiles every program with donation set from the manifest's
alias table (through a persistent compile cache keyed by jaxlib version and device),
and copies the initial state and constants to the device once.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import stepbundle.schema as codec
from stepbundle.schema.manifest import ConstantInput, Manifest, MetricOutput
from stepbundle.schema.version import MATMUL_PRECISION_SINCE
from stepbundle.stablehlo.precision import MATMUL_PRECISIONS

from . import _compat, packing, remote
from .dtypes import array_from_section
from .errors import BindingError, PlatformError
from .init_source import InitSource, open_source
from .init_state import place_state, plan_initial_state
from .load_info import LoadInfo
from .plan import CompiledPlan, Plan, RefusedPlan, batch_text, build_plan, refused_plan
from .program import compile_program, default_cache_dir
from .sharding import Placement, zero1_split
from .store import is_digest, resolve_bundle
from .trainer import Trainer

__all__ = ["load", "parse_device"]

_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def parse_device(device: str) -> tuple[str, int]:
    """``"cuda:1"`` -> ("cuda", 1); ``"cpu"`` -> ("cpu", 0)."""
    name, _, idx = str(device).partition(":")
    name = name.strip().lower()
    if name == "gpu":
        name = "cuda"
    if name not in _PLATFORMS:
        raise PlatformError(
            f"Unknown device {device!r}. Use one of {', '.join(_PLATFORMS)}, optionally with "
            "an index (cuda:1)."
        )
    try:
        index = int(idx) if idx else 0
    except ValueError:
        raise PlatformError(f"Bad device index in {device!r}; use for example cuda:0.") from None
    return name, index


def _client(platform: str) -> Any:
    try:
        return _compat.get_client(platform)
    except RuntimeError as e:  # jax: "Unknown backend cuda", "Backend 'tpu' failed to initialize"
        raise PlatformError(
            f"No {platform} device is available to jax here ({e}). Install jax's plugin "
            f"for {platform} (for CUDA: pip install 'jax[cuda12]') or run with --device cpu."
        ) from None


def _select_devices(client: Any, platform: str, device: str, devices: int | str) -> list[Any]:
    """The devices a run uses: one local device, or the first N devices of the job."""
    _, index = parse_device(device)
    local = list(client.local_devices())
    if isinstance(devices, bool) or not isinstance(devices, (int, str)):
        raise PlatformError(f"devices must be a whole number or 'all', got {devices!r}.")
    if devices == 1:
        if index >= len(local):
            raise PlatformError(
                f"Device {platform}:{index} does not exist; this machine has "
                f"{len(local)} {platform} device(s)."
            )
        return [local[index]]
    everywhere = list(client.devices())
    if isinstance(devices, str):
        if devices != "all":
            raise PlatformError(f"devices must be a number or 'all', got {devices!r}.")
        n = len(everywhere)
    else:
        if devices < 1:
            raise PlatformError(f"devices must be a whole number of at least 1, got {devices!r}.")
        n = devices
    if ":" in str(device):
        raise PlatformError(
            f"Pick either one device ({device!r}) or a number of devices (devices={devices}), "
            f"not both: a data-parallel run uses the first N {platform} devices of the job."
        )
    if n > len(everywhere):
        hint = (
            " On a CPU, ask for N virtual devices before jax starts: "
            "stepbundle.runtime.distributed.set_cpu_devices(N), or "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N. The CLI sets them itself "
            "for --devices N unless XLA_FLAGS already sets a count."
            if platform == "cpu"
            else " For devices on several hosts, start every host's process with "
            "jax.distributed (the CLI's --coordinator, --num-processes, --process-id)."
        )
        raise PlatformError(
            f"A data-parallel run over {n} devices needs {n} {platform} devices, but the "
            f"job has {len(everywhere)}.{hint}"
        )
    chosen = everywhere[:n]
    processes = {d.process_index for d in everywhere}
    missing = processes - {d.process_index for d in chosen}
    if missing:
        # Every process would wait for the left-out ones at the first checkpoint.
        raise PlatformError(
            f"The first {n} {platform} devices of the job leave out process(es) "
            f"{', '.join(map(str, sorted(missing)))}; every process of a multi-process job "
            "must take part. Use devices='all' or a number that covers every process's "
            "devices."
        )
    return chosen


def _check_loss_metrics(manifest: Manifest, entries: list[str]) -> None:
    """``stop_on_nonfinite`` watches the metric called ``loss``: every program that updates
    the state must have one, with one element, or there would be nothing to watch."""
    for name in entries:
        entry = manifest.entries[name]
        if not entry.updates_state:
            continue
        for i, program in enumerate(entry.programs):
            metrics = [o for o in program.outputs if isinstance(o, MetricOutput)]
            loss = next((o for o in metrics if o.name == "loss"), None)
            where = f"entries.{name}.programs[{i}]"
            if loss is None:
                names = ", ".join(repr(o.name) for o in metrics) or "none"
                raise BindingError(
                    f"stop_on_nonfinite watches the metric 'loss', but {where} has no metric "
                    f"of that name (its metrics: {names}). Return the loss as "
                    "{'loss': loss, ...} from the step and export again, or run without "
                    "stopping on non-finite losses."
                )
            if loss.spec.numel != 1:
                raise BindingError(
                    f"stop_on_nonfinite watches the metric 'loss', but in {where} it is "
                    f"{loss.spec}, not a single number. Return a scalar loss from the step."
                )


def load(
    path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    entry: str | list[str] | None = None,
    cache_dir: str | os.PathLike[str] | bool | None = True,
    expect_digest: str | None = None,
    stop_on_nonfinite: bool = False,
    check_state: bool = False,
    devices: int | str = 1,
    pack_state: bool | int = True,
    shard_optimizer_state: bool = False,
    init_from: str | os.PathLike[str] | None = None,
    init_strict: bool = True,
    compile_only: bool = False,
    steps_per_call: int = 1,
    matmul_precision: str | None = None,
) -> Trainer:
    """Load a bundle and return a ``Trainer`` that owns its state on ``device``.

    Args:
      path: the bundle file, a URL (``https://``, ``file://``, and ``gs://``, ``s3://``, ...
        with their fsspec backend installed), fetched once into the local bundle store
        (``store.py``), or ``"sha256:<hex>"`` of a bundle in the store.
      device: platform name, optionally with an index: "cpu", "cuda", "cuda:1", "tpu".
      entry: entry point(s) to compile; None compiles every entry of the bundle.
      cache_dir: persistent compilation cache. True (default): ``$STEPBUNDLE_CACHE_DIR``
        or ``~/.cache/stepbundle``; a path or URL: that folder (shared by every host
        that can reach it); False or None: no cache.
      expect_digest: refuse any bundle whose digest ("sha256:...") differs.
      stop_on_nonfinite: compile without donation, check every step's metrics, and stop
        (``NonFiniteLossError``) before a step with a NaN or infinite metric replaces
        the state (costs a sync per step and a second copy of the state).
      check_state: with ``stop_on_nonfinite``, also check every step's new state on the
        device (one reduction per step) and stop before NaN or infinite values enter
        it, even when the metrics look finite.
      pack_state: keep the small state tensors the training step reads in one device
        buffer per dtype (see ``packing.py``): True packs tensors of up to 65536
        elements, an int sets that limit, False keeps one buffer per tensor. The
        programs compute the same either way; packing removes most of the per-buffer
        cost of a step with hundreds of state tensors.
      devices: number of devices to run on, or "all". With N > 1 the run is data
        parallel over the first N devices of the job (every process's, when
        ``jax.distributed`` joined several): each step takes the global batch, split
        on its first dimension, and the state is replicated. The programs are the
        bundle's own, compiled with XLA's SPMD partitioner; nothing is re-exported.
        Only shape buckets whose batch splits evenly over N can run.
      shard_optimizer_state: with N > 1 devices, split optimizer state (tensors whose
        first dimension is a multiple of N) over the devices instead of replicating
        it (ZeRO stage 1); each device then holds 1/N of it.
      init_from: a checkpoint to take the initial state from, in place of the bundle's:
        a ``.safetensors`` file (PyTorch's, Hugging Face's, or one the runtime wrote), a
        Hugging Face ``model.safetensors.index.json`` with its shards, or a
        ``save_pretrained`` folder. Its tensors are matched to the state table by name
        (or alias), checked for dtype and shape before anything is placed, and copied to
        the device one at a time. Entries it lacks keep the bundle's value (stored, or
        by rule: a fresh optimizer's zeros); a bundle exported without state needs it.
      init_strict: with ``init_from``, refuse a checkpoint that holds tensors the state
        table does not name, or lacks a parameter (default). False ignores the first
        and keeps the bundle's value for the second; a missing entry the bundle has no
        value for, and any dtype or shape mismatch, are refused either way.
      compile_only: compile every program (filling the compile cache) and place nothing:
        no state is read or copied to the device, so a bundle without weights needs no
        ``init_from``. The trainer returned has ``load_info`` and refuses to step
        (``stepbundle compile`` uses it to pre-warm a shared cache).
      steps_per_call: K > 1 also compiles each train program behind a loop of K steps
        (``multistep.py``): ``Trainer.run`` then dispatches K steps per call, and
        ``Trainer.step_many`` takes a stack of K batches. The results are bit for bit
        those of K single steps; callbacks see the state at the end of each call (see
        ``Trainer.run``). The single-step programs are compiled too (for ``step`` and
        for a run's last steps when they do not fill a call).
      matmul_precision: "default", "high" or "highest": set on every matmul and
        convolution of every program before it is compiled (``stablehlo/precision.py``;
        part of the compile-cache key). On the CPU all three compute the same. None: the
        precision the manifest records (``"default"`` for bundles before format 1.2).
    """
    t0 = time.perf_counter()
    info = LoadInfo()
    source: InitSource | None = None  # init_from's files, open while the state is placed
    platform, index = parse_device(device)
    if expect_digest is None and is_digest(path):
        expect_digest = os.fspath(path)  # a digest names one bundle: hold the file to it
    bundle = codec.open_bundle(resolve_bundle(path, expect_digest=expect_digest))
    try:
        if expect_digest is not None and bundle.digest != expect_digest:
            raise BindingError(
                f"The bundle {os.fspath(path)!r} has digest {bundle.digest}, not the expected "
                f"{expect_digest}. Refusing to run a different bundle than the one pinned."
            )
        manifest = bundle.manifest
        wanted = (
            list(manifest.entries)
            if entry is None
            else ([entry] if isinstance(entry, str) else list(entry))
        )
        for name in wanted:
            if name not in manifest.entries:
                raise BindingError(
                    f"The bundle has no entry {name!r}; it has {', '.join(manifest.entries)}."
                )
        if check_state and not stop_on_nonfinite:
            raise BindingError(
                "check_state=True needs stop_on_nonfinite=True: the state can only be kept "
                "when the programs do not donate it."
            )
        if stop_on_nonfinite:
            _check_loss_metrics(manifest, wanted)
        if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int):
            raise BindingError(
                f"steps_per_call must be a whole number of at least 1, got {steps_per_call!r}."
            )
        if steps_per_call < 1:
            raise BindingError(
                f"steps_per_call must be a whole number of at least 1, got {steps_per_call}."
            )
        if matmul_precision is not None and matmul_precision not in MATMUL_PRECISIONS:
            raise BindingError(
                f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)} or None, "
                f"got {matmul_precision!r}."
            )
        if matmul_precision is None and bundle.version >= MATMUL_PRECISION_SINCE:
            matmul_precision = manifest.matmul_precision
        # None: a bundle older than the field, whose programs keep their own settings
        # (torch_xla wrote precision_config into the ops under a non-default precision).
        info.matmul_precision = matmul_precision
        stacked_entry = "train" if steps_per_call > 1 and "train" in wanted else None
        # ---- where the initial state comes from: checked before anything is compiled
        if compile_only and init_from is not None:
            raise BindingError("compile_only places no state: drop init_from.")
        source = open_source(init_from) if init_from is not None else None
        init_plan = (
            None if compile_only else plan_initial_state(manifest, source, strict=init_strict)
        )
        if init_plan is not None:
            info.state_origins = {name: o.value for name, o in init_plan.origins.items()}
            info.ignored_tensors = init_plan.unexpected
        info.seconds["open"] = time.perf_counter() - t0
        client = _client(platform)
        run_devices = _select_devices(client, platform, device, devices)
        n = len(run_devices)
        if stacked_entry is not None and len({d.process_index for d in run_devices}) > 1:
            raise BindingError(
                f"steps_per_call={steps_per_call} is not supported in a multi-process job "
                "yet (each process would stack only its own rows of every batch). Run "
                "with steps_per_call=1 (--steps-per-call 1)."
            )
        if cache_dir is True:
            cache: Path | str | None = default_cache_dir()
        elif cache_dir is False or cache_dir is None:
            cache = None
        else:
            cache = remote.local_path(cache_dir) or os.fspath(cache_dir)

        # ---- programs
        t1 = time.perf_counter()
        limit = packing.DEFAULT_MAX_ELEMENTS if pack_state is True else int(pack_state)
        apart: frozenset[str] = frozenset()
        if shard_optimizer_state and n > 1:
            apart = zero1_split(manifest, packing.unpacked(manifest), n)
        layout = (
            packing.plan_layout(manifest, limit, apart) if limit > 0 else packing.unpacked(manifest)
        )
        placement = Placement(run_devices, apart)
        state_index = {name: i for i, name in enumerate(layout.buffer_names)}
        compiled: dict[str, list[Any]] = {}
        stacked: list[Any] = []  # the train programs behind a loop of K steps
        for name in wanted:
            ent = manifest.entries[name]
            progs: list[Any] = []
            for i, program in enumerate(ent.programs):
                where = f"entries.{name}.programs[{i}]"
                why = placement.indivisible(program)
                if why is not None:
                    progs.append(_refusal(name, i, program, why, placement, ent.programs))
                    continue
                compile_kw: dict[str, Any] = {
                    "where": where,
                    "donate": ent.updates_state and not stop_on_nonfinite,
                    "cache_dir": cache,
                    "layout": layout,
                    "matmul_precision": matmul_precision,
                }
                section = bundle.section(program.section)
                cp = compile_program(client, placement, section, program, **compile_kw)
                info.cache_hits += int(cp.cache_hit)
                info.compiled += int(not cp.cache_hit)
                info.cache[f"{name}[{i}]"] = cp.cache
                progs.append(cp)
                if name == stacked_entry:
                    kp = compile_program(
                        client, placement, section, program, **compile_kw,
                        steps_per_call=steps_per_call,
                    )  # fmt: skip
                    info.cache_hits += int(kp.cache_hit)
                    info.compiled += int(not kp.cache_hit)
                    info.cache[f"{name}[{i}]x{steps_per_call}"] = kp.cache
                    stacked.append((i, kp))
            refused = [p for p in progs if isinstance(p, RefusedPlan)]
            if refused and len(refused) == len(progs) and ent.updates_state:
                raise PlatformError(refused[0].refusal)
            compiled[name] = progs
        info.seconds["compile"] = time.perf_counter() - t1

        # ---- state and constants on the device
        t2 = time.perf_counter()

        state = (
            []
            if init_plan is None
            else place_state(manifest, layout, init_plan, bundle.section, placement.put_state)
        )
        constants: dict[str, Any] = {}
        for name in [] if compile_only else wanted:
            for program in manifest.entries[name].programs:
                for inp in program.inputs:
                    if isinstance(inp, ConstantInput) and inp.section not in constants:
                        constants[inp.section] = placement.put_replicated(
                            array_from_section(bundle.section(inp.section), inp.spec)
                        )
        info.seconds["state"] = time.perf_counter() - t2
        info.transfer = _compat.transfer_path()
        plans: dict[str, list[Plan]] = (
            {
                name: [
                    p
                    if isinstance(p, RefusedPlan)
                    else build_plan(name, i, p, state_index, constants, placement)
                    for i, p in enumerate(progs)
                ]
                for name, progs in compiled.items()
            }
            if not compile_only
            else {name: [] for name in compiled}
        )
        stacked_plans: dict[int, CompiledPlan] = (
            {i: build_plan("train", i, kp, state_index, constants, placement) for i, kp in stacked}
            if not compile_only
            else {}
        )
        digest = bundle.digest
    finally:
        bundle.close()
        if source is not None:
            source.close()
    info.dispatch = {
        f"{name}[{i}]": p.dispatch.path
        for name, entry_plans in plans.items()
        for i, p in enumerate(entry_plans)
        if not isinstance(p, RefusedPlan)
    }
    for i, stacked_plan in stacked_plans.items():
        info.dispatch[f"train[{i}]x{steps_per_call}"] = stacked_plan.dispatch.path
    info.seconds["total"] = time.perf_counter() - t0
    trainer = Trainer(
        manifest=manifest,
        digest=digest,
        placement=placement,
        layout=layout,
        state=state,
        plans=plans,
        hyperparameters={h.name: h.value for h in manifest.hyperparameters},
        seed=manifest.rng.seed if manifest.rng is not None else None,
        stop_on_nonfinite=stop_on_nonfinite,
        check_state=check_state,
        load_info=info,
        steps_per_call=steps_per_call if stacked_entry is not None else 1,
        stacked_plans=stacked_plans,
    )
    if compile_only:
        trainer._broken = (
            "This trainer was loaded with compile_only=True: it compiled the programs and "
            "holds no state. Load the bundle again without compile_only to run it."
        )
    return trainer


def _refusal(
    entry: str, index: int, program: Any, why: str, placement: Placement, programs: Any
) -> RefusedPlan:
    """A plan for a shape bucket that cannot run on the placement: it refuses batches."""
    n = placement.n
    usable = [batch_text(p) for p in placement.usable_buckets(programs)]
    fix = (
        f"Use a batch of a bucket that does: {' | '.join(usable)}."
        if usable
        else f"Export with a batch size that is a multiple of {n}, or run on fewer devices."
    )
    message = (
        f"The {entry!r} entry's shape bucket {index} cannot run data-parallel over {n} "
        f"devices: {why}. {fix}"
    )
    return refused_plan(entry, index, program, message)
