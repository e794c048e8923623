"""Version constants of the bundle format and the reader's acceptance rule.

There is one version axis, the container-and-manifest format ``(major, minor)``, written in
every bundle's header. The acceptance rule is decided here, once, so that old readers never
freeze the writer:

* a different major is refused;
* the same major with an older or equal minor is read;
* the same major with a newer minor is read when every name in the manifest's
  ``required_features`` is in ``KNOWN_FEATURES``; unknown manifest keys are then ignored;
* a bundle that requires a feature this reader does not know is refused, whatever its minor.

Imports: standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import UnsupportedVersionError

__all__ = [
    "FORMAT_VERSION",
    "KNOWN_FEATURES",
    "MATMUL_PRECISIONS",
    "NUMERICS",
    "NUMERICS_PYTORCH",
    "NUMERICS_TORCH_XLA",
    "RNG_RESTORED_DRAWS",
    "STATE_INITIALIZERS",
    "check_major",
    "check_version",
    "format_version_string",
]

# Changelog of the format version (bump the minor for additions old readers may ignore,
# the major for anything else; `python -m stepbundle.schema.describe` says which):
# 2026-11-30: 1.0, first version
# 2026-12-01: 1.1, additions:
#   - Manifest.metadata (a map of strings for people and tools; default {});
#   - section kinds ``fill`` (one element, repeated over a state's shape) and ``external``
#     (no bytes: the state's value is supplied at load), for state entries only, under the
#     required feature ``state_initializers``: bundles without weights;
#   - Entry.eval_modules (the modules in eval mode while the entry was traced; default []).
#   - Manifest.numerics (``"pytorch"`` or ``"torch_xla"``; default nil: not recorded): whether
#     the exporter replaced ops XLA expands in numerically weak forms (training BatchNorm) by
#     PyTorch's formulas in plain StableHLO. Informational, so no required feature: any
#     reader runs both kinds of program correctly.
# 2026-12-02: 1.2, additions:
#   - Rng.restored_after_draws and Rng.step_after_draws (default [] and 0), under the
#     required feature ``rng_restored_draws``: a step that restores torch_xla's RNG state
#     mid-step (torch_xla.utils.checkpoint recomputing dropout).
#   - Manifest.matmul_precision (``"default"``, ``"high"`` or ``"highest"``; default
#     ``"default"``): the matmul precision the step was traced under. Old readers may ignore
#     it; the runtime sets it on every dot_general and convolution at load.
FORMAT_VERSION: tuple[int, int] = (1, 2)

STATE_INITIALIZERS = "state_initializers"
"""Required by a bundle whose state entries name ``fill`` or ``external`` sections (1.1): a
reader that does not know it would find no stored value for those states."""

# Features this reader understands. A writer lists in ``Manifest.required_features`` every
# feature a reader must understand to use the bundle correctly; a reader refuses a bundle
# naming one that is not here. 1.0 had none.
RNG_RESTORED_DRAWS = "rng_restored_draws"
"""Required by a bundle whose ``Rng.step_after_draws`` is not 0 (1.2): a reader that does
not know it would advance the seed by the plain rule and draw other random numbers."""

KNOWN_FEATURES: frozenset[str] = frozenset({STATE_INITIALIZERS, RNG_RESTORED_DRAWS})


NUMERICS_PYTORCH = "pytorch"
NUMERICS_TORCH_XLA = "torch_xla"
NUMERICS: frozenset[str] = frozenset({NUMERICS_PYTORCH, NUMERICS_TORCH_XLA})
"""The values ``Manifest.numerics`` may take (1.1): ``pytorch``, the programs compute
training BatchNorm as PyTorch's kernels do (mean first, then the mean of squared
deviations), in plain StableHLO ops; ``torch_xla``, the programs are as torch_xla lowered
them (``batch_norm_training`` / ``batch_norm_grad``, which XLA expands with E[x^2] - E[x]^2)."""

MATMUL_PRECISIONS: tuple[str, ...] = ("default", "high", "highest")
MATMUL_PRECISION_SINCE: tuple[int, int] = (1, 2)
"""The format version that added ``Manifest.matmul_precision``: an older bundle records
none (it decodes as "default"), and its programs keep their own ``precision_config``."""
"""The values ``Manifest.matmul_precision`` may take (1.2), StableHLO's ``precision_config``
values in lower case: ``default`` lets the backend choose (TF32 or bf16 passes on some
accelerators), ``highest`` asks for full float32 accuracy."""


def format_version_string(version: tuple[int, int]) -> str:
    """``(1, 0)`` -> ``"1.0"``."""
    return f"{version[0]}.{version[1]}"


def check_major(found: tuple[int, int]) -> None:
    """Refuse a bundle whose major version differs from this reader's.

    Called as soon as the header is read, before the manifest is trusted: a different
    major may lay out everything after the version field differently.
    """
    if found[0] != FORMAT_VERSION[0]:
        newer = found[0] > FORMAT_VERSION[0]
        advice = (
            "Upgrade stepbundle to a release that reads it."
            if newer
            else "Re-export the bundle with this stepbundle release."
        )
        raise UnsupportedVersionError(
            f"The bundle has format version {format_version_string(found)}, but this "
            f"reader supports format versions {FORMAT_VERSION[0]}.0 to "
            f"{format_version_string(FORMAT_VERSION)} (and newer {FORMAT_VERSION[0]}.x "
            f"bundles that need no unknown features). {advice}",
            found=found,
        )


def check_version(found: tuple[int, int], required_features: Iterable[str]) -> None:
    """Apply the acceptance rule to a bundle's version and required features.

    Raises:
      UnsupportedVersionError: the major differs, or a required feature is unknown to
        this reader. Its ``missing_features`` lists the unknown features.
    """
    check_major(found)
    missing = tuple(sorted({f for f in required_features if f not in KNOWN_FEATURES}))
    if missing:
        names = ", ".join(repr(f) for f in missing)
        raise UnsupportedVersionError(
            f"The bundle (format version {format_version_string(found)}) requires "
            f"feature(s) {names} that this reader (format version "
            f"{format_version_string(FORMAT_VERSION)}) does not know. Upgrade stepbundle "
            "to a release that supports them, or re-export without them.",
            found=found,
            missing_features=missing,
        )
