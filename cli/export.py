"""``stepbundle export``: build a recipe and write its bundle, with either front-end.

Imports a front-end (torch and torch_xla, or torch and jax) only when the command runs,
so the rest of the CLI works in the lean environment.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from .common import die as _die

__all__ = ["cmd_export"]


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


def _choose_frontend(asked: str) -> tuple[str, str]:
    """The front-end to use and why (``stepbundle.choose_frontend``); raises SystemExit
    when it cannot run here."""
    from stepbundle import FrontendMissingError, choose_frontend

    try:
        return choose_frontend(asked)
    except FrontendMissingError as e:
        raise SystemExit(_die(str(e))) from None


def cmd_export(args: argparse.Namespace) -> int:
    frontend, why = _choose_frontend(getattr(args, "frontend", "auto"))
    recipe_file = args.recipe.rpartition(":")[0]
    outputs_exist = Path(recipe_file).exists() and Path(args.output).exists()
    if recipe_file and outputs_exist and os.path.samefile(recipe_file, args.output):
        return _die(f"-o {args.output!r} is the recipe file; writing it would destroy it.")
    if Path(args.output).is_dir():
        return _die(f"-o {args.output!r} is a folder; give the bundle a file name.")
    folder = Path(args.output).parent
    if not os.access(folder if str(folder) else ".", os.W_OK) or not folder.is_dir():
        return _die(f"-o {args.output!r}: the folder {str(folder)!r} is missing or not writable.")
    print(f"[export] front-end: {frontend} ({why})", file=sys.stderr)
    from stepbundle.frontend.errors import ExportError
    from stepbundle.frontend.recipe import Recipe

    t0 = time.perf_counter()
    export: Any
    if frontend == "torch_xla":
        from stepbundle.exporter import export as export_xla
        from stepbundle.exporter.workspace import xla_device

        # Create the XLA device before the recipe runs any CPU autograd (torch_xla
        # asserts in autograd's engine otherwise).
        xla_device()
        export = export_xla
    else:
        from stepbundle.export_torch.export import export as export_torch

        export = export_torch
    fn = _load_recipe(args.recipe)
    recipe = fn()
    if not isinstance(recipe, Recipe):
        return _die(
            f"{args.recipe} returned {type(recipe).__name__}, not a stepbundle.exporter.Recipe"
        )
    if args.no_state:
        recipe.include_state = False
    print(f"[export] recipe built in {time.perf_counter() - t0:.2f}s", file=sys.stderr)

    from stepbundle.frontend.progress import StageLine

    # Which stage the export is in and how far (a bar on a terminal); whole lines go
    # through it, so that they never land inside the bar.
    line = StageLine(sys.stderr)

    def progress(msg: str) -> None:
        line.write(f"[export] {msg}")

    try:
        report = export(
            recipe,
            args.output,
            mlir_dir=args.emit_mlir,
            progress=progress,
            check=False if getattr(args, "no_check", False) else None,
            ticker=line,
        )
    except ExportError as e:
        line.close()
        return _die(str(e), 1)
    finally:  # an error's traceback starts on a line of its own too
        line.close()
    counts = ", ".join(f"{v} {k}" for k, v in sorted(report.input_counts.items()))
    stages = ", ".join(f"{k} {v:.2f}s" for k, v in report.stage_seconds.items())
    print(f"[export] train inputs: {counts}", file=sys.stderr)
    print(f"[export] stages: {stages}; total {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    print(f"{report.path}\t{report.size} bytes\t{report.digest}")
    return 0
