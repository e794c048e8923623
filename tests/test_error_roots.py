"""Every error stepbundle raises is a ``StepbundleError`` under exactly one of five roots.

The roots (``stepbundle.schema.errors``, re-exported by ``stepbundle``): ``BundleError``,
``CheckpointError``, ``DataError``, ``DeviceError`` and ``UsageError``. Two checks:

1. every exception class a stepbundle module defines (every module imported, as
   pyproject.toml's package-dir installs them) derives from exactly one root, except a
   few named classes of control flow inside the package, each of which must be caught
   inside the package (read from the source with ``ast``);
2. every ``raise`` of a builtin exception type in the package's source is one of the
   kinds Python's protocols or a programming error call for (``KeyError`` from a
   mapping, ``TypeError`` for an argument of the wrong type, ...), or one named below
   that the package catches and turns into its own error before a caller sees it.

Runs where every front-end imports (the torch_xla environment).
"""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest
from test_layering import modules

import stepbundle
from stepbundle.schema.errors import (
    BundleError,
    CheckpointError,
    DataError,
    DeviceError,
    StepbundleError,
    UsageError,
)

ROOTS = (BundleError, CheckpointError, DataError, DeviceError, UsageError)

# Control flow inside the package, never raised to a caller: each is caught where named.
INTERNAL = {
    "stepbundle.cli.stopping.StopRequested": "cli/train_loop.py ends the run at a step boundary",
    "stepbundle.exporter.gradients.GradientsDropped": "exporter/export.py traces again",
    "stepbundle.exporter.gradients.NoGradient": "exporter/export.py traces again",
    "stepbundle.export_torch.export._GradientsDropped": "frontend_torch/export.py retraces",
    "stepbundle.export_torch.lowering.UnsupportedOperator": "an ExportError in export.py",
    "stepbundle.export_torch.lowering.LoweringError": "an ExportError in export.py",
    "stepbundle.stablehlo.mask_values._Unknown": "compute_mask says why it computed nothing",
    "stepbundle.frontend.step_eager.CannotReproduce": "frontend_core/step_check.py skips or "
    "leaves unarbitrated",
    "stepbundle.frontend.step_ties._Mismatch": "step_ties.arbitrate looks for no tie",
}

# A builtin exception of these kinds may be raised: the protocols and programming errors.
PROTOCOL_BUILTINS = {
    "KeyError",  # a mapping's lookup
    "IndexError",  # a sequence's lookup
    "StopIteration",  # an iterator's end
    "TypeError",  # an argument of the wrong type (or a schema definition's bug)
    "NotImplementedError",  # the torch lowering's "not this form", caught there
    "AssertionError",  # unreachable
    "AttributeError",  # a module's __getattr__
    "SystemExit",  # the command ends with its exit code
}

# Builtins raised where the package itself catches them and raises its own error (or
# ends the command with its exit code): file -> the builtins, and why.
CAUGHT_INSIDE = {
    "runtime/data/shard_file.py": (
        {"ValueError"},
        "read_npy_header's, as numpy's own header errors: dataset.py's and tokens.py's open, one DataError",
    ),
    "frontend_torch/graph.py": ({"ValueError"}, "frontend_torch/capture.py: an ExportError"),
    "cli/outputs.py": ({"OSError"}, "the CLI's exit code 2"),
    "cli/record_file.py": ({"OSError"}, "a SinkError (a DataError) in the same module"),
    "cli/sinks.py": (
        {"OSError", "ImportError", "FileExistsError"},
        "a SinkError, or the CLI's exit code 2",
    ),
    "runtime/_compat.py": ({"TimeoutError"}, "placement/distributed.py: a PlatformError"),
}

ROOT = Path(__file__).resolve().parent.parent


def _package_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in modules():
        if name == "stepbundle.__main__":  # runs the command
            continue
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and not issubclass(value, Warning)  # warned, never raised
                and value.__module__.startswith("stepbundle")
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


@pytest.fixture(scope="module")
def classes() -> dict[str, type[BaseException]]:
    return _package_classes()


def _caught_names() -> set[str]:
    """Every name an ``except`` clause of the package names."""
    names: set[str] = set()
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                for sub in ast.walk(node.type):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
                    elif isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
    return names


def test_the_roots_are_five_stepbundle_errors_and_the_face_exports_them() -> None:
    assert all(issubclass(r, StepbundleError) for r in ROOTS)
    assert not any(issubclass(a, b) for a in ROOTS for b in ROOTS if a is not b)
    assert issubclass(UsageError, ValueError)
    for root in (*ROOTS, StepbundleError):
        assert getattr(stepbundle, root.__name__) is root
        assert root.__name__ in stepbundle.__all__


def test_every_exception_class_is_under_exactly_one_root(
    classes: dict[str, type[BaseException]],
) -> None:
    assert len(classes) > 20, sorted(classes)  # the walk found the package
    outside = {
        name: [b.__name__ for b in cls.__mro__[1:]]
        for name, cls in classes.items()
        if cls is not StepbundleError
        and name not in INTERNAL
        and sum(issubclass(cls, root) for root in ROOTS) != 1
    }
    assert not outside, f"exception classes not under exactly one root: {outside}"


def test_internal_control_flow_is_caught_inside_the_package(
    classes: dict[str, type[BaseException]],
) -> None:
    missing = sorted(set(INTERNAL) - set(classes))
    assert not missing, f"INTERNAL names classes that no longer exist: {missing}"
    caught = _caught_names()
    uncaught = sorted(n for n in INTERNAL if n.rsplit(".", 1)[1] not in caught)
    assert not uncaught, f"internal exceptions no except clause of the package names: {uncaught}"


def _raised_builtins(path: Path) -> set[str]:
    raised: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(target, ast.Name):
            value = getattr(builtins, target.id, None)
            if isinstance(value, type) and issubclass(value, BaseException):
                raised.add(target.id)
    return raised


def test_builtin_exceptions_are_raised_only_where_protocols_or_the_package_catch_them() -> None:
    bad: dict[str, list[str]] = {}
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        allowed = PROTOCOL_BUILTINS | CAUGHT_INSIDE.get(rel, (set(), ""))[0]
        wrong = sorted(_raised_builtins(path) - allowed)
        if wrong:
            bad[rel] = wrong
    assert not bad, (
        f"raise one of the roots (stepbundle.schema.errors: UsageError for a wrong "
        f"argument) instead of these builtins: {bad}"
    )


def test_caught_inside_lists_only_files_that_still_raise_them() -> None:
    stale = {
        rel: sorted(names - _raised_builtins(ROOT / rel))
        for rel, (names, _why) in CAUGHT_INSIDE.items()
        if names - _raised_builtins(ROOT / rel)
    }
    assert not stale, f"CAUGHT_INSIDE lists builtins these files no longer raise: {stale}"
