"""Compiling a load's programs: every shape bucket of each wanted entry (and its
K-step program behind a loop), with one client, placement, layout and compile cache;
buckets the placement cannot split refused as plans; what each compiled program decided,
per program, for ``LoadInfo``.

``load`` and ``compile_offline`` both compile through ``EntryCompiler``.

Imports: numpy, stepbundle.schema, the runtime's compile, placement and train rooms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

import stepbundle.schema as codec
from stepbundle.schema.manifest import ConstantInput, Program

from .compile.compile_cache import CompileCache
from .compile.program import CompiledProgram, compile_program
from .compile.state_masks import unwritten_state
from .dtypes import array_from_section
from .errors import PlatformError
from .placement import packing
from .placement.sharding import Placement
from .train.plan import RefusedPlan, batch_text, refused_plan

__all__ = ["EntryCompiler", "bucket_refusal", "per_program", "scalar_constants"]


@dataclass(frozen=True)
class EntryCompiler:
    """Compiles the programs of a load with the same client, placement, layout and cache
    (whose ``events`` say what it did for each)."""

    client: Any
    placement: Placement
    layout: packing.Layout
    cache: CompileCache
    matmul_precision: str | None
    donate: bool  # False under stop_on_nonfinite: a refused step keeps the old state
    fused_attention: bool
    head_barriers: bool | None  # None: weighed on a TPU (compile_program)
    initial: Callable[[str], np.ndarray[Any, Any] | None] | None  # state values as loaded
    bf16_products: bool = True  # on a TPU (rewrites.bf16_products)
    regather_weights: bool | Literal["auto"] = "auto"  # fsdp, fsdp+tp (regather_choice.py)
    device_memory: int | None = None  # for "auto": None asks the devices

    def entry(
        self, bundle: codec.Bundle, name: str, k: int, stacked: dict[int, CompiledProgram]
    ) -> list[CompiledProgram | RefusedPlan]:
        """Every shape bucket of entry ``name``: compiled, or refused on this placement.
        With ``k`` > 1, each bucket's K-step program goes into ``stacked`` too."""
        ent = bundle.manifest.entries[name]
        progs: list[CompiledProgram | RefusedPlan] = []
        for i, program in enumerate(ent.programs):
            why = self.placement.indivisible(program)
            if why is not None:
                progs.append(bucket_refusal(name, i, program, why, self.placement, ent.programs))
                continue
            section = bundle.section(program.section)
            scalars = scalar_constants(bundle, program)
            args = (section, program, name, i, ent.updates_state, scalars)
            one = self._compile(*args)
            if k > 1:  # behind the loop, as the one-step program was compiled
                try:
                    stacked[i] = self._compile(*args, k, one.head_barriers, one.regathered)
                except Exception as e:
                    if not (one.head_barriers and self.head_barriers is None):
                        raise
                    # "auto" chose barriers the K-step program does not compile with: both
                    # without them (the one-step program's is in the cache), as before
                    why = " ".join(str(e).split())[:300]
                    one = dataclasses.replace(
                        self._compile(*args, 1, False, one.regathered),
                        head_choice=f"{one.head_choice}; but its {k}-step program did not "
                        f"compile with them ({type(e).__name__}: {why}): both compiled without",
                    )
                    stacked[i] = self._compile(*args, k, False, one.regathered)
            progs.append(one)
        refused = [p for p in progs if isinstance(p, RefusedPlan)]
        if refused and len(refused) == len(progs) and ent.updates_state:
            raise PlatformError(refused[0].refusal)
        return progs

    def _head_barriers(self, updates_state: bool) -> bool | None:
        """``compile_program``'s head_barriers: as asked, and under "auto" (None) weighed
        for a training program on one device only (``head_choice.py``)."""
        if self.head_barriers is None and (not updates_state or self.placement.partitioned):
            return False
        return self.head_barriers

    def _compile(
        self,
        section: Any,
        program: Program,
        name: str,
        i: int,
        updates_state: bool,
        scalars: dict[int, float],
        k: int = 1,
        head_barriers: bool | Literal["weigh"] = "weigh",
        regather: bool | None = None,
    ) -> CompiledProgram:
        """Compile bucket ``i`` of entry ``name`` (behind a loop of ``k`` steps for k > 1,
        with ``head_barriers`` and ``regather`` as its one-step program was compiled;
        "weigh" and None: as the options say, ``_head_barriers``)."""
        return compile_program(
            self.client,
            self.placement,
            section,
            program,
            where=f"entries.{name}.programs[{i}]",
            label=f"{name}[{i}]" + (f"x{k}" if k > 1 else ""),
            donate=updates_state and self.donate,
            cache=self.cache,
            layout=self.layout,
            matmul_precision=self.matmul_precision,
            steps_per_call=k,
            fused_attention=self.fused_attention,
            scalar_constants=scalars,
            state_values=unwritten_state(program, self.initial),
            head_barriers=(
                self._head_barriers(updates_state) if head_barriers == "weigh" else head_barriers
            ),
            bf16_products=self.bf16_products,
            regather_weights=self.regather_weights if regather is None else regather,
            device_memory=self.device_memory,
        )


def per_program(
    compiled: Mapping[str, list[CompiledProgram | RefusedPlan]],
    fact: Callable[[CompiledProgram], Any],
) -> dict[str, Any]:
    """``"entry[i]"`` -> ``fact`` of each compiled program, where it is not empty (the
    ``LoadInfo`` fields that are said per program)."""
    return {
        f"{name}[{i}]": value
        for name, progs in compiled.items()
        for i, p in enumerate(progs)
        if isinstance(p, CompiledProgram) and (value := fact(p))
    }


def scalar_constants(bundle: codec.Bundle, program: Program) -> dict[int, float]:
    """The program's one-element constant arguments: argument number -> value, a float
    for a floating type and an int for an integer or boolean one (a rewrite may depend
    on one: an attention mask's fill value, or the integer offset torch_xla captures
    into the positions Hugging Face's causal masks are built from)."""
    out: dict[int, float] = {}
    for i, inp in enumerate(program.inputs):
        if isinstance(inp, ConstantInput) and inp.spec.numel == 1:
            value = array_from_section(bundle.section(inp.section), inp.spec).reshape(-1)[0]
            floating = inp.spec.dtype.value in ("f64", "f32", "f16", "bf16")
            out[i] = float(value) if floating else int(value)
    return out


def bucket_refusal(
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
