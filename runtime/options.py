"""What ``load`` is asked to do: frozen option records, each checked when it is made.

``load(path, device, options=LoadOptions(...))`` takes one ``LoadOptions``, grouped by
concern: ``CompileOptions`` (what is compiled, and how), ``StateOptions`` (where the
initial state comes from, how it is held), ``SafetyOptions`` (what is refused) and
``ParallelOptions`` (how many devices). Every record checks its own fields, and
``LoadOptions`` the rules between groups, in ``__post_init__``: a bad option fails where
it is written, with the typed error ``load`` raised for it before, and before any file
is opened. Checks that need the bundle (an entry it lacks, a missing ``loss`` metric) or
the devices (more than the job has) stay with ``load``.

``LoadOptions.from_keywords`` builds the records from flat names
(``LoadOptions.from_keywords(steps_per_call=8, init_from=path)``), for scripts and for
code that passes options through as keywords.

Imports: stepbundle.schema and stepbundle.stablehlo (the precision names).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from stepbundle.stablehlo.precision import MATMUL_PRECISIONS

from .errors import UsageError
from .placement.layout_spec import DataSplit, LayoutError, ParallelLayout, ShardRule, parse_layout

__all__ = [
    "CompileOptions",
    "LoadOptions",
    "ParallelOptions",
    "SafetyOptions",
    "StateOptions",
]

PathLike = str | os.PathLike[str]


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flags(record: object, *names: str) -> None:
    """Refuse a field that should be True or False but is something else ("yes", 1)."""
    for name in names:
        value = getattr(record, name)
        if not isinstance(value, bool):
            raise UsageError(f"{name} must be True or False, got {value!r}.")


def _path_or_none(name: str, value: object) -> None:
    """Refuse a field that should be a path (a str or os.PathLike) or None."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise UsageError(
            f"{name} must be a path (a str or os.PathLike) or None, got {value!r} "
            f"({type(value).__name__})."
        )
    if isinstance(value, str) and not value:
        raise UsageError(f"{name} must be a path or None, got an empty string.")


# More steps per call than this is no batch count a host could stack (a call holds its K
# batches at once); 8 or 32 take most of the gain.
MAX_STEPS_PER_CALL = 1 << 20

# File systems that live only in this process: a cache there is gone when it ends.
_PROCESS_LOCAL = ("memory://",)


@dataclass(frozen=True)
class CompileOptions:
    """What is compiled, and how.

    Attributes:
      entries: the entry points to compile (a name or several); None compiles every
        entry of the bundle. Kept as a tuple.
      cache_dir: persistent compilation cache. True (default): ``$STEPBUNDLE_CACHE_DIR``
        or ``~/.cache/stepbundle``; a path or URL: that folder (shared by every host
        that can reach it); False or None: no cache.
      steps_per_call: K > 1 also compiles each train program behind a loop of K steps
        (``multistep.py``): ``Trainer.run`` then dispatches K steps per call, and
        ``Trainer.step_many`` takes a stack of K batches. The results are bit for bit
        those of K single steps; callbacks see the state at the end of each call (see
        ``Trainer.run``). The single-step programs are compiled too (for ``step`` and
        for a run's last steps when they do not fill a call). "auto": ``load`` first
        times the training step at one step per call and takes 32, 8 or 1
        (``runtime/auto_steps.py``); ``LoadInfo.auto_steps`` says what it chose and why.
      cadences: step counts at which the caller needs the state between calls, such
        as "checkpoint every N" and "evaluate every N" (0: none); "auto" halves K until
        it divides each (``stepbundle run`` passes ``--checkpoint-every`` and
        ``--eval-every``). A given K is taken as it is. Kept as a tuple.
      matmul_precision: "default", "high" or "highest": set on every matmul and
        convolution of every program before it is compiled (``stablehlo/precision.py``;
        part of the compile-cache key). On the CPU all three compute the same. On an
        accelerator "high" and "highest" also compute small float32 powers to whole
        exponents exactly (Adam's bias corrections; ``stablehlo/pow_precision.py``).
        None: the precision the manifest records (``"default"`` before format 1.2).
      compile_only: compile every program (filling the compile cache) and place nothing:
        no state is read or copied to the device, so a bundle without weights needs no
        ``init_from``. The trainer returned has ``load_info`` and refuses to step
        (``stepbundle compile`` uses it to pre-warm a shared cache).
      fused_attention: on one TPU at the default precision, run traced attention
        (bf16, causal or unmasked) as jax's splash-attention kernels, forward and
        backward (``stablehlo/attention.py``). False keeps the program's own attention.
      keep_freed_memory: before compiling for a TPU, tell glibc's allocator to keep the
        memory it frees rather than give it back to the system at once
        (``runtime/compile/allocator.py``: the TPU compiler's passes allocate and free a great
        deal, and on a sandboxed host each give-back is a slow system call). Process-wide,
        once; skipped where a ``MALLOC_*`` variable is set. True applies it, False leaves
        the allocator alone, "auto" (default) applies it only where a system call is
        measured slow (``STEPBUNDLE_KEEP_FREED_MEMORY`` = 1/0 decides an "auto" instead);
        ``LoadInfo.allocator`` says what was done and why.
      head_barriers: optimization barriers around the output head's products (a product
        with a dimension of a vocabulary: a size of at least 16,384 that the program's
        embedding is looked up along), which keep XLA from fusing a transformer's residual
        stream into them (``runtime/compile/head_choice.py``). "auto" (default): for a
        training program on one TPU, where the compiled program has the stream fused into
        a head product, it is compiled with the barriers too and the one libtpu's cost
        model prices lower is kept (one more compile for such a program; its
        steps-per-call program follows; eval entries and layouts over several devices are
        not weighed).
        True puts them in every program that has a head (eval entries too), on every
        platform (they change no value); False never. ``LoadInfo.head_barriers`` says what
        was done.
      bf16_products: on one TPU, write a bf16 x bf16 product that the program computes
        float32-out and rounds to bf16 (the torch front-end's form of an autocast product)
        bf16-out, the weight gradients among them in torch_xla's operand order
        (``stablehlo/bf16_products.py``): each product the same bits on a v5e, and fewer
        relayouts and float32 temporaries. False compiles the products as written. No
        effect on other platforms (a CPU rounds a bf16-out product otherwise), over several
        devices (the partial sums would be added in bf16), or on programs that write their
        products bf16-out already (torch_xla's). ``LoadInfo.bf16_products`` counts them.
      regather_weights: under a layout that splits parameters over the data axis
        (``fsdp``, ``fsdp+tp``), each product of such a parameter after its first reads its
        own copy behind an optimization barrier, so the partitioner gathers the weight
        again for the backward pass (``stablehlo/regather.py``): the same values; the 8B
        of docs/parallel.md fits a v5e-256 only with it (a v5e-64 was compiled with it
        only), and the 1.1B on a v5e-8 needs more memory with it (12.77 against 9.46 GiB a
        chip). "auto" (default): each such program is compiled as
        written, and with the rewrite too only where the first does not fit (the compiler
        refused it for memory, or XLA's memory analysis exceeds ``device_memory``); the
        rewritten program is kept where it was refused, or unless it needs more
        (``runtime/compile/regather_choice.py``; one more compile for such a program; its
        steps-per-call program follows). True always rewrites, False never.
        ``LoadInfo.regathered_products`` counts the products, ``LoadInfo.regather_choice``
        says what "auto" compared.
      device_memory: the bytes a program may use on one device, against which
        ``regather_weights="auto"`` weighs XLA's memory analysis (to leave room, or to plan
        for other devices). None (default): what the devices report
        (``memory_stats()["bytes_limit"]`` on a TPU or GPU); a CPU and the described
        devices of ``compile_offline`` report none, and there only a refusal counts.
    """

    entries: tuple[str, ...] | None = None
    cache_dir: PathLike | bool | None = True
    steps_per_call: int | Literal["auto"] = 1
    cadences: tuple[int, ...] = ()
    matmul_precision: str | None = None
    compile_only: bool = False
    fused_attention: bool = True
    keep_freed_memory: bool | Literal["auto"] = "auto"
    head_barriers: bool | Literal["auto"] = "auto"
    bf16_products: bool = True
    regather_weights: bool | Literal["auto"] = "auto"
    device_memory: int | None = None

    def __post_init__(self) -> None:
        entries: object = self.entries
        if isinstance(entries, str):
            object.__setattr__(self, "entries", (entries,))
        elif entries is not None:
            if not isinstance(entries, Sequence) or not all(isinstance(e, str) for e in entries):
                raise UsageError(
                    f"entries must be an entry name, a list of entry names or None, got "
                    f"{entries!r}."
                )
            object.__setattr__(self, "entries", tuple(entries))
        if self.entries is not None and (not self.entries or not all(self.entries)):
            raise UsageError(
                f"entries must name at least one entry, and no empty name, got {entries!r}; "
                "None compiles every entry of the bundle."
            )
        cache: object = self.cache_dir
        if not isinstance(cache, bool) and cache is not None:
            _path_or_none("cache_dir", cache)
            if str(os.fspath(cache)).lower().startswith(_PROCESS_LOCAL):  # type: ignore[call-overload]
                raise UsageError(
                    f"cache_dir={cache!r} is a file system that lives only in this process: "
                    "the compiled programs would be gone when it ends. Give a folder or a "
                    "shared URL, or cache_dir=False for no cache."
                )
        k = self.steps_per_call
        if k != "auto":  # "auto" is measured at load (runtime/auto_steps.py)
            if not isinstance(k, int) or isinstance(k, bool):
                raise UsageError(
                    f'steps_per_call must be a whole number of at least 1 or "auto", got {k!r}.'
                )
            if k < 1:
                raise UsageError(f"steps_per_call must be a whole number of at least 1, got {k}.")
            if k > MAX_STEPS_PER_CALL:
                raise UsageError(
                    f"steps_per_call={k} is more than {MAX_STEPS_PER_CALL}: a call stacks its "
                    "K batches in memory at once. 8 or 32 take most of the gain."
                )
        cadences: object = self.cadences
        if not isinstance(cadences, Sequence) or isinstance(cadences, str):
            cadences = (cadences,)
        if not all(_whole(c) and c >= 0 for c in cadences):  # type: ignore[operator]
            raise UsageError(
                f"cadences must be step counts (whole numbers >= 0; 0: none), got "
                f"{self.cadences!r}."
            )
        object.__setattr__(self, "cadences", tuple(cadences))
        _flags(self, "compile_only", "fused_attention", "bf16_products")
        if not (isinstance(self.regather_weights, bool) or self.regather_weights == "auto"):
            raise UsageError(
                f'regather_weights must be True, False or "auto", got {self.regather_weights!r}.'
            )
        memory = self.device_memory
        if memory is not None and not (_whole(memory) and memory > 0):
            raise UsageError(
                f"device_memory must be a number of bytes (a whole number > 0) or None, got "
                f"{memory!r}."
            )
        if not (isinstance(self.keep_freed_memory, bool) or self.keep_freed_memory == "auto"):
            raise UsageError(
                f'keep_freed_memory must be True, False or "auto", got {self.keep_freed_memory!r}.'
            )
        if not (isinstance(self.head_barriers, bool) or self.head_barriers == "auto"):
            raise UsageError(
                f'head_barriers must be True, False or "auto", got {self.head_barriers!r}.'
            )
        if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
            raise UsageError(
                f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)} or None, "
                f"got {self.matmul_precision!r}."
            )


@dataclass(frozen=True)
class StateOptions:
    """Where the initial state comes from, and how the device holds it.

    Attributes:
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
      pack_state: keep the small state tensors the training step reads in one device
        buffer per dtype (see ``packing.py``): True packs tensors of up to 65536
        elements, a whole number sets that limit (0: off), False keeps one buffer per
        tensor. The programs compute the same either way; packing removes most of the
        per-buffer cost of a step with hundreds of state tensors.
    """

    init_from: PathLike | None = None
    init_strict: bool = True
    pack_state: bool | int = True

    def __post_init__(self) -> None:
        _path_or_none("init_from", self.init_from)
        _flags(self, "init_strict")
        p = self.pack_state
        if not isinstance(p, bool) and (not _whole(p) or p < 0):
            raise UsageError(
                "pack_state must be True, False or a whole number of elements (0: no "
                f"packing), got {p!r}."
            )


@dataclass(frozen=True)
class SafetyOptions:
    """What the runtime refuses, beyond what it always refuses.

    Attributes:
      expect_digest: refuse any bundle whose digest ("sha256:...") differs.
      stop_on_nonfinite: compile without donation, check every step's metrics, and stop
        (``NonFiniteLossError``) before a step with a NaN or infinite metric replaces
        the state (costs a sync per step and a second copy of the state).
      check_state: with ``stop_on_nonfinite``, also check every step's new state on the
        device (one reduction per step) and stop before NaN or infinite values enter
        it, even when the metrics look finite.
    """

    expect_digest: str | None = None
    stop_on_nonfinite: bool = False
    check_state: bool = False

    def __post_init__(self) -> None:
        _flags(self, "stop_on_nonfinite", "check_state")
        if self.expect_digest is not None and not isinstance(self.expect_digest, str):
            raise UsageError(
                f"expect_digest must be a bundle digest (sha256:...) or None, got "
                f"{self.expect_digest!r}."
            )
        if self.check_state and not self.stop_on_nonfinite:
            raise UsageError(
                "check_state=True needs stop_on_nonfinite=True: the state can only be kept "
                "when the programs do not donate it."
            )


@dataclass(frozen=True)
class ParallelOptions:
    """How many devices a run uses.

    Attributes:
      devices: number of devices to run on, or "all". With N > 1 the run is data
        parallel over the first N devices of the job (every process's, when
        ``jax.distributed`` joined several): each step takes the global batch, split
        on its first dimension, and the state is replicated. The programs are the
        bundle's own, compiled with XLA's SPMD partitioner; nothing is re-exported.
        Only shape buckets whose batch splits evenly over N can run.
      shard_optimizer_state: with N > 1 devices, split optimizer state (each tensor on
        its first dimension that is a multiple of N) over the devices instead of
        replicating it (ZeRO stage 1); each device then holds 1/N of it. The same as
        ``layout="zero1"``.
      layout: what the devices split, as one spec string (``placement/layout_spec.py``):
        ``"dp"`` (default: the state replicated), ``"zero1"`` (optimizer state split),
        ``"fsdp"`` (parameters, kept gradients and optimizer state split), each
        optionally with ``"+tp"`` or ``"+tp:M"``: a 2-D mesh of N/M x M devices whose
        model axis splits the large matmul weights (``tp_rules``). Kept as the
        normalized spec (``"fsdp+tp:2"``).
      tp_rules: with ``+tp``, which parameters are split on which dimension over the
        model axis (``ShardRule`` s, the first match wins); None: the default rules
        for transformer names (``layout_spec.DEFAULT_TP_RULES``). A rule that
        matches a parameter whose dimension does not divide is refused at load, unless
        it is one of ``DEFAULT_TP_RULES`` (``(ShardRule(...), *DEFAULT_TP_RULES)``: yours
        first, then the defaults, which keep such a parameter whole as without rules).
    """

    devices: int | str = 1
    shard_optimizer_state: bool = False
    layout: str = "dp"
    tp_rules: tuple[ShardRule, ...] | None = None

    def __post_init__(self) -> None:
        d = self.devices
        if isinstance(d, str):
            if d != "all":
                raise UsageError(f"devices must be a number or 'all', got {d!r}.")
        elif not _whole(d):
            raise UsageError(f"devices must be a whole number or 'all', got {d!r}.")
        elif d < 1:
            raise UsageError(f"devices must be a whole number of at least 1, got {d!r}.")
        _flags(self, "shard_optimizer_state")
        parsed = parse_layout(self.layout)  # LayoutError for a spec that does not parse
        if self.shard_optimizer_state and parsed.data is DataSplit.DP:
            parsed = ParallelLayout(DataSplit.ZERO1, parsed.model)
        object.__setattr__(self, "layout", parsed.spec)
        rules: object = self.tp_rules
        if rules is not None:
            if isinstance(rules, ShardRule) or not isinstance(rules, (tuple, list)):
                raise LayoutError(
                    f"tp_rules must be a sequence of ShardRule (or None for the defaults), "
                    f"got {rules!r}."
                )
            for rule in rules:
                if not isinstance(rule, ShardRule):
                    raise LayoutError(
                        f"tp_rules holds {rule!r}; each rule is a ShardRule(pattern, dim)."
                    )
            object.__setattr__(self, "tp_rules", tuple(rules))

    @property
    def parsed_layout(self) -> ParallelLayout:
        """``layout`` as a ``ParallelLayout`` (data split and model axis)."""
        return parse_layout(self.layout)


@dataclass(frozen=True)
class LoadOptions:
    """Everything ``load`` is asked to do besides which bundle and which device.

    Attributes:
      compile: what is compiled, and how (``CompileOptions``).
      state: where the initial state comes from, how it is held (``StateOptions``).
      safety: what is refused (``SafetyOptions``).
      parallel: how many devices (``ParallelOptions``).
    """

    compile: CompileOptions = field(default_factory=CompileOptions)
    state: StateOptions = field(default_factory=StateOptions)
    safety: SafetyOptions = field(default_factory=SafetyOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)

    def __post_init__(self) -> None:
        if self.compile.compile_only and self.state.init_from is not None:
            raise UsageError(
                "compile_only places no state, so it takes no init_from: drop init_from "
                "(--init-from), or load without compile_only to start from the checkpoint."
            )

    @classmethod
    def from_keywords(
        cls,
        *,
        entry: str | list[str] | None = None,
        cache_dir: PathLike | bool | None = True,
        expect_digest: str | None = None,
        stop_on_nonfinite: bool = False,
        check_state: bool = False,
        devices: int | str = 1,
        pack_state: bool | int = True,
        shard_optimizer_state: bool = False,
        layout: str = "dp",
        tp_rules: tuple[ShardRule, ...] | None = None,
        init_from: PathLike | None = None,
        init_strict: bool = True,
        compile_only: bool = False,
        steps_per_call: int | Literal["auto"] = 1,
        cadences: tuple[int, ...] = (),
        matmul_precision: str | None = None,
        fused_attention: bool = True,
        keep_freed_memory: bool | Literal["auto"] = "auto",
        head_barriers: bool | Literal["auto"] = "auto",
        bf16_products: bool = True,
        regather_weights: bool | Literal["auto"] = "auto",
        device_memory: int | None = None,
    ) -> LoadOptions:
        """The options from flat names: each is the field of that name in its record
        (same defaults; ``entry`` is ``CompileOptions.entries``)."""
        return cls(
            compile=CompileOptions(
                entries=None
                if entry is None
                else tuple([entry] if isinstance(entry, str) else entry),
                cache_dir=cache_dir,
                steps_per_call=steps_per_call,
                cadences=cadences,
                matmul_precision=matmul_precision,
                compile_only=compile_only,
                fused_attention=fused_attention,
                keep_freed_memory=keep_freed_memory,
                head_barriers=head_barriers,
                bf16_products=bf16_products,
                regather_weights=regather_weights,
                device_memory=device_memory,
            ),
            state=StateOptions(init_from=init_from, init_strict=init_strict, pack_state=pack_state),
            safety=SafetyOptions(
                expect_digest=expect_digest,
                stop_on_nonfinite=stop_on_nonfinite,
                check_state=check_state,
            ),
            parallel=ParallelOptions(
                devices=devices,
                shard_optimizer_state=shard_optimizer_state,
                layout=layout,
                tp_rules=tp_rules,
            ),
        )
