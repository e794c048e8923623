"""A bound program as the bundle stores it: torch_xla's graph re-read as a StableHLO
portable artifact, its RNG seeds derived from the one seed input (``rng_seeds.py``),
rewritten for ``Recipe.numerics`` (``numerics.py``), checked, and serialized at the oldest
StableHLO target that holds it.

Imports: jaxlib's MLIR bindings (through stepbundle.stablehlo), stepbundle.exporter.
"""

from __future__ import annotations

from stepbundle.frontend.errors import ExportError
from stepbundle.stablehlo import artifact as mlir
from stepbundle.stablehlo.attention_composite import count_composites, stamp_version

from . import xla
from .bind import BoundProgram
from .numerics import apply_numerics
from .rng_seeds import derive_seeds

__all__ = ["lower_program"]

COMPOSITE_SINCE = (0, 19, 0)
"""The first StableHLO version with ``stablehlo.composite`` (``vhlo.composite_v1``): a
program holding one is not tried at older targets (each failure prints MLIR's errors)."""


def _targets(module: mlir.Module) -> list[str]:
    if not count_composites(module):
        return list(mlir.TARGET_CANDIDATES)
    return [
        t
        for t in mlir.TARGET_CANDIDATES
        if tuple(int(x) for x in t.split(".")[:3]) >= COMPOSITE_SINCE
    ]


def _parse(bound: BoundProgram, what: str, numerics: str) -> tuple[mlir.Module, int]:
    """torch_xla's graph, as the portable artifact it serializes (never plain MLIR),
    rewritten for ``numerics`` (``exporter/numerics.py``), and the number of ops rewritten."""
    try:
        module = mlir.parse_artifact(bound.bytecode)
    except ValueError as e:  # stablehlo's ArtifactError, or jaxlib's own read failure
        raise ExportError(
            f"The {what}'s graph, as torch_xla {xla.torch_xla_version()} serialized it, is "
            f"not a StableHLO portable artifact this jaxlib can read ({e}). torch_xla and "
            "jax disagree on the StableHLO version: install the torch_xla and jax versions "
            "stepbundle's export extra names (pip install 'stepbundle[export]')."
        ) from e
    # Serializing converts the module to VHLO in place: every use starts from a fresh parse.
    module.strip_attributes()
    # SDPA's composites (exporter/attention_composites.py): torch_xla writes no version
    stamp_version(module)
    if bound.derived_seeds:
        assert bound.seed_input is not None
        derive_seeds(module, bound.seed_input, bound.derived_seeds)
    return module, apply_numerics(module, numerics, what)


def lower_program(
    bound: BoundProgram, n_outputs: int, what: str, numerics: str
) -> tuple[bytes, str, str, int]:
    """The program's portable artifact, its target, its text and the ops rewritten."""
    module, rewrites = _parse(bound, what, numerics)
    sig = module.signature()
    if len(sig.inputs) != len(bound.inputs) or len(sig.results) != n_outputs:
        raise ExportError(
            f"Internal error lowering the {what}: torch_xla's graph has {len(sig.inputs)} "
            f"inputs and {len(sig.results)} outputs, the trace accounted for "
            f"{len(bound.inputs)} and {n_outputs}. Please report this with the recipe."
        )
    bad = module.custom_call_targets() - mlir.ALLOWED_CUSTOM_CALLS
    if bad:
        raise ExportError(
            f"The {what} lowers to custom call(s) {sorted(bad)}, which the runtime does not "
            "allow (they are backend-specific native code). Use ops torch_xla lowers to "
            "plain StableHLO."
        )
    text = module.text()
    errors = []
    for target in _targets(module):
        attempt, _ = _parse(bound, what, numerics)
        try:
            return attempt.portable_artifact(target), target, text, rewrites
        except Exception as e:  # the program needs a newer StableHLO than this target
            errors.append(f"{target}: {e}")
    raise ExportError(
        f"The {what} could not be serialized as a StableHLO portable artifact at any "
        f"supported target ({'; '.join(errors)})."
    )
