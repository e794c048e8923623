"""stepbundle: trace a PyTorch training step once, run it anywhere PJRT runs.

The face::

    from stepbundle import Recipe, export          # where torch is installed
    from stepbundle import LoadOptions, Trainer, load
    from stepbundle import CompileOptions, ParallelOptions, SafetyOptions, StateOptions
    from stepbundle import BundleError, CheckpointError, DataError, DeviceError, UsageError

``export(recipe, path)`` writes a bundle with the torch_xla front-end where torch_xla is
installed and with the torch front-end otherwise (``frontend=`` chooses); ``load(path,
device, LoadOptions(...))`` returns the ``Trainer`` that runs it, with no torch;
``LoadOptions`` is made of the four option records beside it. Each
name is imported on first use, so ``import stepbundle.runtime`` never pulls in torch and
``import stepbundle.schema`` pulls in neither torch nor jax. Every error stepbundle raises
is a ``StepbundleError`` under one of the five roots imported above
(``stepbundle.schema.errors`` says what each covers).

Subpackages: ``stepbundle.schema`` (the format), ``stepbundle.stablehlo`` (StableHLO
shared by both sides), ``stepbundle.frontend`` (what both front-ends share),
``stepbundle.exporter`` (the torch_xla front-end), ``stepbundle.export_torch`` (the torch
front-end), ``stepbundle.runtime`` (lean, no torch) and ``stepbundle.cli`` (the command).
The version lives in ``stepbundle._version``, which any layer may import.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from stepbundle.schema.errors import (
    BundleError,
    CheckpointError,
    DataError,
    DeviceError,
    StepbundleError,
    UsageError,
)

from ._version import __version__

if TYPE_CHECKING:
    from stepbundle.frontend.recipe import Recipe
    from stepbundle.runtime.load import load
    from stepbundle.runtime.options import (
        CompileOptions,
        LoadOptions,
        ParallelOptions,
        SafetyOptions,
        StateOptions,
    )
    from stepbundle.runtime.train.trainer import Trainer

__all__ = [
    "FRONTENDS",
    "BundleError",
    "CheckpointError",
    "CompileOptions",
    "DataError",
    "DeviceError",
    "FrontendMissingError",
    "LoadOptions",
    "ParallelOptions",
    "Recipe",
    "SafetyOptions",
    "StateOptions",
    "StepbundleError",
    "Trainer",
    "UsageError",
    "__version__",
    "choose_frontend",
    "export",
    "load",
]

FRONTENDS = ("auto", "torch_xla", "torch")
"""The front-ends ``export`` takes: ``auto`` is torch_xla where it is installed, else torch."""


class FrontendMissingError(UsageError, ImportError):
    """The front-end asked for (or any, for ``auto``) is not installed; the message says
    which extra installs it. A ``UsageError``, and an ``ImportError`` as before."""


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def choose_frontend(asked: str = "auto") -> tuple[str, str]:
    """The front-end ``export`` uses for ``asked`` and why, in words.

    Raises:
      ValueError: ``asked`` is not one of ``FRONTENDS``.
      FrontendMissingError: it needs a package that is not installed.
    """
    if asked not in FRONTENDS:
        raise UsageError(f"frontend must be one of {', '.join(FRONTENDS)}, got {asked!r}.")
    if asked == "auto":
        if _installed("torch_xla"):
            return "torch_xla", "torch_xla is installed"
        if _installed("torch"):
            return "torch", "torch_xla is not installed"
        raise FrontendMissingError(
            "Exporting needs torch: install a front-end, pip install "
            "'stepbundle[export-torch]' (current torch and jax) or 'stepbundle[export]' "
            "(torch 2.9 + torch_xla). Running bundles needs neither."
        )
    need = ("torch", "torch_xla") if asked == "torch_xla" else ("torch", "jax")
    extra = "export" if asked == "torch_xla" else "export-torch"
    missing = [n for n in need if not _installed(n)]
    if missing:
        raise FrontendMissingError(
            f"The {asked} front-end needs {' and '.join(need)}, and {', '.join(missing)} "
            f"is not installed. Install its extra: pip install 'stepbundle[{extra}]'. "
            "Running bundles does not need it."
        )
    return asked, "asked for"


def export(
    recipe: Recipe, path: str | os.PathLike[str], *, frontend: str = "auto", **options: Any
) -> Any:
    """Trace ``recipe``'s step once and write its bundle to ``path``.

    Args:
      recipe: the model, optimizer, step and example batch (``stepbundle.Recipe``).
      path: where the bundle is written (atomically).
      frontend: "auto", "torch_xla" or "torch" (``choose_frontend``).
      **options: the chosen front-end's own ``export`` options (``mlir_dir``,
        ``progress``, ``check``, ...).

    Returns:
      The front-end's ``ExportReport``.

    Example:
      >>> report = stepbundle.export(recipe(), "linear.stepbundle")  # doctest: +SKIP
    """
    chosen, _ = choose_frontend(frontend)
    if chosen == "torch_xla":
        from stepbundle.exporter import export as export_xla

        return export_xla(recipe, path, **options)
    from stepbundle.export_torch import export as export_torch

    return export_torch(recipe, path, **options)


_RUNTIME_NAMES = (
    "load",
    "LoadOptions",
    "CompileOptions",
    "StateOptions",
    "SafetyOptions",
    "ParallelOptions",
    "Trainer",
)


def __getattr__(name: str) -> Any:
    """``Recipe``, ``load``, ``LoadOptions`` (and its four records) and ``Trainer``,
    imported on first use; ``Recipe`` without torch is a ``FrontendMissingError`` naming
    the extra to install."""
    if name == "Recipe":
        if not _installed("torch"):  # a Recipe holds torch objects: name the way out
            raise FrontendMissingError(
                "stepbundle.Recipe holds a torch model and optimizer, and torch is not "
                "installed. Install a front-end to export: pip install "
                "'stepbundle[export-torch]' (current torch and jax) or 'stepbundle[export]' "
                "(torch 2.9 + torch_xla). Running bundles needs neither (load, LoadOptions, "
                "Trainer)."
            )
        from stepbundle.frontend.recipe import Recipe

        return Recipe
    if name in _RUNTIME_NAMES:
        from stepbundle import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'stepbundle' has no attribute {name!r}")
