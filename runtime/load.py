"""``load(path, device, options)``: open a bundle, compile its programs, put its state on the device.

Loading validates the bundle (``stepbundle.schema``), checks each section's digest
before its first use, compiles every program with donation set from the manifest's
alias table (through a persistent compile cache keyed by jaxlib version and device),
and copies the initial state and constants to the device once. What to do is a
``LoadOptions`` (``options.py``), checked before anything is opened.

Imports: numpy, jax/jaxlib (through _compat), stepbundle.schema.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import stepbundle.schema as codec
from stepbundle.schema.manifest import (
    ConstantInput,
    Manifest,
    MetricOutput,
    StateInput,
)
from stepbundle.schema.version import MATMUL_PRECISION_SINCE

from . import _compat
from .auto_steps import resolve_auto_steps
from .compile import allocator
from .compile.compile_cache import CompileCache
from .compile.cpu_numerics import cpu_numerics
from .compile.load_info import LoadInfo
from .compile.program import CompiledProgram
from .compile.state_masks import MaskPins, digest_of
from .dtypes import array_from_section
from .entry_compiler import EntryCompiler, per_program
from .errors import BindingError, UsageError
from .fallback import PathChoice
from .io import remote
from .io.store import default_cache_dir, is_digest, resolve_bundle
from .options import LoadOptions
from .placement import packing
from .placement.devices import client_for, parse_device, select_devices
from .placement.layout_spec import DataSplit
from .placement.shard_plan import plan_shards
from .placement.sharding import Placement
from .state.init_source import InitSource, open_source
from .state.init_state import InitPlan, Origin, place_state, plan_initial_state
from .train.plan import CompiledPlan, Plan, RefusedPlan, build_plan
from .train.trainer import Trainer

__all__ = ["load"]


def load(
    path: str | os.PathLike[str],
    device: str = "cpu",
    options: LoadOptions | None = None,
) -> Trainer:
    """Load a bundle and return a ``Trainer`` that owns its state on ``device``.

    Args:
      path: the bundle file, a URL (``https://``, ``file://``, and ``gs://``, ``s3://``, ...
        with their fsspec backend installed), fetched once into the local bundle store
        (``store.py``), or ``"sha256:<hex>"`` of a bundle in the store.
      device: platform name, optionally with an index: "cpu", "cuda", "cuda:1", "tpu".
      options: what to compile, where the state comes from, what to refuse and on how
        many devices (``LoadOptions``; every field is documented there). None: the
        defaults (every entry, the default compile cache, the bundle's state, one device).

    Raises:
      BundleNotFoundError: no file at a local ``path`` (a ``UsageError``, and a
        ``FileNotFoundError``).
      UsageError: ``options`` is not a ``LoadOptions``, or asks for what this bundle or
        these devices cannot do (a layout that does not divide them).
      BundleError: the bundle cannot be read, trusted, fetched or compiled.
      CheckpointError: ``init_from`` cannot give the initial state (``InitStateError``).
      DeviceError: the device cannot run the bundle (``PlatformError``).

    Example:
      >>> trainer = load("linear.stepbundle", "cpu",
      ...                LoadOptions(CompileOptions(steps_per_call=8)))  # doctest: +SKIP
    """
    if options is not None and not isinstance(options, LoadOptions):
        raise UsageError(
            f"load() takes its options as a LoadOptions, got {type(options).__name__}. Build "
            "one: LoadOptions(compile=CompileOptions(...), ...), or from flat names with "
            "LoadOptions.from_keywords(steps_per_call=8, ...)."
        )
    opts = options if options is not None else LoadOptions()
    t0 = time.perf_counter()
    opts, auto = resolve_auto_steps(load, path, device, opts)  # "auto": measured first
    info = LoadInfo(auto_steps=auto.describe() if auto is not None else "")
    source: InitSource | None = None  # init_from's files, open while the state is placed
    platform, _ = parse_device(device)
    bundle = _open_bundle(path, opts.safety.expect_digest)
    compile_only = opts.compile.compile_only
    try:
        manifest = bundle.manifest
        wanted = _wanted_entries(manifest, opts)
        info.matmul_precision = _matmul_precision(bundle, opts.compile.matmul_precision)
        k = int(opts.compile.steps_per_call)
        stacked_entry = "train" if k > 1 and "train" in wanted else None
        # Where the initial state comes from: checked before anything is compiled.
        init_from = opts.state.init_from
        source = open_source(init_from) if init_from is not None else None
        init_plan = None if compile_only else _plan_state(manifest, source, opts, info)
        info.seconds["open"] = time.perf_counter() - t0
        if platform == "tpu":
            # before the TPU runtime starts: set after, it changed nothing (allocator.py)
            info.kept_freed_memory, info.allocator = allocator.decide(
                opts.compile.keep_freed_memory
            )
        if platform == "cpu":
            info.cpu_numerics = cpu_numerics().words
        client = client_for(platform)
        run_devices = select_devices(client, device, opts.parallel.devices)
        if stacked_entry is not None and len({d.process_index for d in run_devices}) > 1:
            raise BindingError(
                f"steps_per_call={k} is not supported in a multi-process job yet (each "
                "process would stack only its own rows of every batch). Run with "
                "steps_per_call=1 (--steps-per-call 1)."
            )
        layout, placement = _layout_and_placement(manifest, opts, run_devices, bundle, wanted)
        info.layout, info.mesh = placement.layout, dict(placement.mesh_axes)
        info.layout_notes = placement.plan.notes if placement.plan is not None else ()

        t1 = time.perf_counter()
        cache = CompileCache(_cache_folder(opts.compile.cache_dir), writer=placement.writes_files)
        compiler = EntryCompiler(
            initial=_initial_values(manifest, init_plan, bundle),
            client=client,
            placement=placement,
            layout=layout,
            cache=cache,
            matmul_precision=info.matmul_precision,
            donate=not opts.safety.stop_on_nonfinite,
            fused_attention=opts.compile.fused_attention,
            head_barriers=(
                None if opts.compile.head_barriers == "auto" else bool(opts.compile.head_barriers)
            ),
            bf16_products=opts.compile.bf16_products,
            regather_weights=opts.compile.regather_weights,
            device_memory=opts.compile.device_memory,
        )
        compiled: dict[str, list[CompiledProgram | RefusedPlan]] = {}
        stacked: dict[int, CompiledProgram] = {}  # the train programs behind a loop of K steps
        for name in wanted:
            compiled[name] = compiler.entry(
                bundle, name, k if name == stacked_entry else 1, stacked
            )
        cache.warn(stacklevel=2)  # load()'s caller
        info.cache, info.cache_hits, info.compiled = cache.events, cache.hits, cache.compiled
        info.fused_attention = per_program(compiled, lambda p: p.fused_attention)
        info.head_barriers = per_program(compiled, lambda p: p.head_choice)
        info.bf16_products = per_program(
            compiled,
            lambda p: (p.bf16_products, p.bf16_weight_gradients) if p.bf16_products else (),
        )
        info.regathered_products = per_program(compiled, lambda p: p.regathered_products)
        info.regather_choice = per_program(compiled, lambda p: p.regather_choice)
        info.attention_kept = per_program(compiled, lambda p: list(p.attention_kept))
        pins = _mask_pins(compiled, compiler.initial)
        info.seconds["compile"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        if compile_only:
            state: list[Any] = []
            constants: dict[str, Any] = {}
        else:
            assert init_plan is not None
            state = place_state(manifest, layout, init_plan, bundle.section, placement.put_state)
            constants = _place_constants(bundle, wanted, placement)
            info.state_bytes_per_device = max(placement.bytes_per_device(state).values(), default=0)
        info.seconds["state"] = time.perf_counter() - t2
        info.transfer = _compat.transfer_path()
        plans: dict[str, list[Plan]] = {name: [] for name in compiled}
        stacked_plans: dict[int, CompiledPlan] = {}
        if not compile_only:
            plans, stacked_plans = _plans(compiled, stacked, layout, constants, placement)
        digest = bundle.digest
    finally:
        bundle.close()
        if source is not None:
            source.close()
    info.dispatch = _dispatch_paths(plans, stacked_plans, k)
    info.seconds["total"] = time.perf_counter() - t0
    refusal = (
        "This trainer was loaded with compile_only=True: it compiled the programs and "
        "holds no state. Load the bundle again without compile_only to run it."
    )
    return Trainer(
        manifest=manifest,
        digest=digest,
        placement=placement,
        layout=layout,
        state=state,
        plans=plans,
        hyperparameters={h.name: h.value for h in manifest.hyperparameters},
        seed=manifest.rng.seed if manifest.rng is not None else None,
        stop_on_nonfinite=opts.safety.stop_on_nonfinite,
        check_state=opts.safety.check_state,
        load_info=info,
        steps_per_call=k if stacked_entry is not None else 1,
        stacked_plans=stacked_plans,
        refusal=refusal if compile_only else None,
        pins=pins,
    )


def _initial_values(
    manifest: Manifest, plan: InitPlan | None, bundle: codec.Bundle
) -> Callable[[str], np.ndarray[Any, Any] | None] | None:
    """A state entry's value as the load places it (the bundle's, or ``init_from``'s),
    for the rewrites that read a mask buffer; None for a fill rule, or without a plan
    (``compile_only``). Each value is read when asked for, and kept for the pins."""
    if plan is None:
        return None
    entries = {s.name: s for s in manifest.state}
    read: dict[str, np.ndarray[Any, Any] | None] = {}

    def initial(name: str) -> np.ndarray[Any, Any] | None:
        if name not in read:
            origin = plan.origins[name]
            if origin is Origin.FILE:
                f, key = plan.from_file[name]
                read[name] = np.array(f.array(key))
            elif origin is Origin.STORED:
                entry = entries[name]
                read[name] = np.array(array_from_section(bundle.section(entry.section), entry.spec))
            else:
                read[name] = None
        return read[name]

    return initial


def _mask_pins(
    compiled: dict[str, list[CompiledProgram | RefusedPlan]],
    initial: Callable[[str], np.ndarray[Any, Any] | None] | None,
) -> MaskPins:
    """The mask buffers the compiled programs assume, each with its loaded value's digest."""
    programs: dict[str, list[str]] = {}
    for name, progs in compiled.items():
        for i, p in enumerate(progs):
            if isinstance(p, CompiledProgram):
                for state in p.pinned_state:
                    programs.setdefault(state, []).append(f"{name}[{i}]")
    pins: dict[str, tuple[str, tuple[str, ...]]] = {}
    for state, labels in programs.items():
        value = initial(state) if initial is not None else None
        assert value is not None  # a pinned mask was read from this value
        pins[state] = (digest_of(value), tuple(labels))
    return MaskPins(pins)


def _plans(
    compiled: dict[str, list[CompiledProgram | RefusedPlan]],
    stacked: dict[int, CompiledProgram],
    layout: packing.Layout,
    constants: dict[str, Any],
    placement: Placement,
) -> tuple[dict[str, list[Plan]], dict[int, CompiledPlan]]:
    """Each compiled program's dispatch plan (refused buckets stay refusals), and the
    train buckets' K-step plans."""
    state_index = {name: i for i, name in enumerate(layout.buffer_names)}
    plans: dict[str, list[Plan]] = {
        name: [
            p
            if isinstance(p, RefusedPlan)
            else build_plan(name, i, p, state_index, constants, placement)
            for i, p in enumerate(progs)
        ]
        for name, progs in compiled.items()
    }
    stacked_plans = {
        i: build_plan("train", i, kp, state_index, constants, placement)
        for i, kp in stacked.items()
    }
    return plans, stacked_plans


def _dispatch_paths(
    plans: dict[str, list[Plan]], stacked_plans: dict[int, CompiledPlan], k: int
) -> dict[str, PathChoice]:
    """How each program's steps are dispatched, by ``"entry[i]"`` (``"train[i]xK"``)."""
    paths = {
        f"{name}[{i}]": p.dispatch.path
        for name, entry_plans in plans.items()
        for i, p in enumerate(entry_plans)
        if not isinstance(p, RefusedPlan)
    }
    for i, stacked_plan in stacked_plans.items():
        paths[f"train[{i}]x{k}"] = stacked_plan.dispatch.path
    return paths


def _plan_state(
    manifest: Manifest, source: InitSource | None, opts: LoadOptions, info: LoadInfo
) -> InitPlan:
    """Where each state entry's initial value comes from (checked before anything is
    compiled), recorded in ``info``."""
    plan = plan_initial_state(manifest, source, strict=opts.state.init_strict)
    info.state_origins = {name: o.value for name, o in plan.origins.items()}
    info.ignored_tensors = plan.unexpected
    return plan


def _open_bundle(path: str | os.PathLike[str], expect_digest: str | None) -> codec.Bundle:
    """The bundle at ``path`` (fetched into the store for a URL), held to ``expect_digest``."""
    if expect_digest is None and is_digest(path):
        expect_digest = os.fspath(path)  # a digest names one bundle: hold the file to it
    bundle = codec.open_bundle(resolve_bundle(path, expect_digest=expect_digest))
    if expect_digest is not None and bundle.digest != expect_digest:
        bundle.close()
        raise BindingError(
            f"The bundle {os.fspath(path)!r} has digest {bundle.digest}, not the expected "
            f"{expect_digest}. Refusing to run a different bundle than the one pinned."
        )
    return bundle


def _wanted_entries(manifest: Manifest, opts: LoadOptions) -> list[str]:
    """The entries to compile, each one the bundle has (and with a loss metric to watch
    under ``stop_on_nonfinite``)."""
    entries = opts.compile.entries
    wanted = list(manifest.entries) if entries is None else list(entries)
    for name in wanted:
        if name not in manifest.entries:
            hint = (
                " A bundle has an eval entry when its recipe names one: export it again "
                "with Recipe(eval_step=...)."
                if name == "eval"
                else ""
            )
            raise BindingError(
                f"The bundle has no entry {name!r}; it has {', '.join(manifest.entries)}.{hint}"
            )
    if opts.safety.stop_on_nonfinite:
        _check_loss_metrics(manifest, wanted)
    return wanted


def _matmul_precision(bundle: codec.Bundle, asked: str | None) -> str | None:
    """The precision set on every matmul: the one asked for, else the manifest's.

    None: a bundle older than the field, whose programs keep their own settings
    (torch_xla wrote precision_config into the ops under a non-default precision).
    """
    if asked is None and bundle.version >= MATMUL_PRECISION_SINCE:
        return bundle.manifest.matmul_precision
    return asked


def _cache_folder(cache_dir: str | os.PathLike[str] | bool | None) -> Path | str | None:
    """The compile cache's folder (a local path, or a URL), or None for no cache."""
    if cache_dir is True:
        return default_cache_dir()
    if cache_dir is False or cache_dir is None:
        return None
    return remote.local_path(cache_dir) or os.fspath(cache_dir)


def _lookups(bundle: codec.Bundle, wanted: list[str]) -> dict[str, frozenset[int]]:
    """State name -> the dimensions the programs' lookups (gathers) index in it, read from
    the first program of each entry in ``wanted`` (``stablehlo/lookups.py``)."""
    from stepbundle.stablehlo.artifact import parse_artifact
    from stepbundle.stablehlo.lookups import lookup_dims

    out: dict[str, frozenset[int]] = {}
    for name in wanted:
        programs = bundle.manifest.entries[name].programs
        if not programs:
            continue
        program = programs[0]
        module = parse_artifact(bundle.section(program.section))
        for arg, dims in lookup_dims(module).items():
            row = program.inputs[arg] if arg < len(program.inputs) else None
            if isinstance(row, StateInput):
                out[row.name] = out.get(row.name, frozenset()) | dims
    return out


def _layout_and_placement(
    manifest: Manifest,
    opts: LoadOptions,
    run_devices: list[Any],
    bundle: codec.Bundle,
    wanted: list[str],
) -> tuple[packing.Layout, Placement]:
    """How the state is held (packs; tensors the parallel layout splits stay apart) and
    where it lives. An FSDP layout reads which tables the programs of ``wanted`` look
    rows up in (``plan_shards``'s ``lookups``)."""
    pack = opts.state.pack_state
    limit = packing.DEFAULT_MAX_ELEMENTS if pack is True else int(pack)
    layout_spec = opts.parallel.parsed_layout
    lookups = None
    splits_data = len(run_devices) > layout_spec.model
    if layout_spec.data == DataSplit.FSDP and splits_data:
        lookups = _lookups(bundle, wanted)
    plan = plan_shards(
        manifest, layout_spec, len(run_devices), opts.parallel.tp_rules, lookups=lookups
    )
    apart = frozenset(plan.dims)
    layout = (
        packing.plan_layout(manifest, limit, apart) if limit > 0 else packing.unpacked(manifest)
    )
    return layout, Placement(run_devices, plan)


def _place_constants(
    bundle: codec.Bundle, wanted: list[str], placement: Placement
) -> dict[str, Any]:
    """Every constant input of the wanted entries on the device, once per section."""
    constants: dict[str, Any] = {}
    for name in wanted:
        for program in bundle.manifest.entries[name].programs:
            for inp in program.inputs:
                if isinstance(inp, ConstantInput) and inp.section not in constants:
                    constants[inp.section] = placement.put_replicated(
                        array_from_section(bundle.section(inp.section), inp.spec)
                    )
    return constants


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
