"""Imports go one way: the declared layers, no cycles, no undeclared edges.

The picture (an arrow reads "may import"):

    cli ──▶ exporter ──▶ stablehlo ──▶ schema ──▶ stepbundle (the package root: version only)
     │  │      └───▶ frontend ──▶ schema
     │  ├─▶ export_torch ──▶ stablehlo, schema, frontend
     │  └─▶ runtime  ──▶ stablehlo
     └────────────────────────────────▶ schema
    cli ──▶ face (``stepbundle`` itself: load, export, Recipe, ...) ──▶ runtime, exporter,
            export_torch, frontend (each on first use)

The front-end core (``frontend``, folder ``frontend_core/``) is what both front-ends
share; it and the torch front-end (``export_torch``, folder ``frontend_torch/``) never
import torch_xla, nor the torch_xla front-end (``exporter``), which is the only layer that
does.

The exporter and the runtime never import each other. Every import counts, including
those inside functions (a lazy import is still an edge, and a lazy cycle is still a
cycle), and so does ``importlib.import_module("...")`` or ``__import__("...")`` with a
constant name; an import of a computed name is refused outside ``DYNAMIC_IMPORT_ALLOWLIST``.
The graph is read from the source with ``ast``, following pyproject.toml's package-dir
mapping (subfolders included: one holding modules the mapping misses fails, since the
wheel would not contain it), so the test needs nothing installed and sees exactly the
checkout. Third-party rules ride along: the schema imports the standard library and
msgpack only, the runtime and the StableHLO module never import torch or safetensors.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent

# layer -> the layers it may import (itself always allowed).
ALLOWED: dict[str, frozenset[str]] = {
    "stepbundle": frozenset(),
    "schema": frozenset({"stepbundle"}),
    "stablehlo": frozenset({"stepbundle", "schema"}),
    "runtime": frozenset({"stepbundle", "schema", "stablehlo"}),
    "frontend": frozenset({"stepbundle", "schema"}),
    "exporter": frozenset({"stepbundle", "schema", "stablehlo", "frontend"}),
    "export_torch": frozenset({"stepbundle", "schema", "stablehlo", "frontend"}),
    # The command is a shell over the library, the face included (choose_frontend).
    "cli": frozenset(
        {
            "stepbundle",
            "face",
            "schema",
            "stablehlo",
            "runtime",
            "exporter",
            "export_torch",
            "frontend",
        }
    ),
    # The package's own module (``package/__init__.py``): the face users import from
    # (``from stepbundle import load, export``), each name imported on first use.
    "face": frozenset(
        {"stepbundle", "schema", "stablehlo", "runtime", "exporter", "export_torch", "frontend"}
    ),
}
# layer -> third-party top-level modules it must never import.
# safetensors: the runtime reads and writes it itself, and only the test extras install the
# library, so an import would pass the tests and break a plain install.
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "schema": frozenset({"torch", "torch_xla", "jax", "jaxlib", "numpy", "safetensors"}),
    "stablehlo": frozenset({"torch", "torch_xla", "numpy", "safetensors"}),
    "runtime": frozenset({"torch", "torch_xla", "torchvision", "transformers", "safetensors"}),
    "stepbundle": frozenset({"torch", "torch_xla", "jax", "jaxlib", "numpy"}),
    "export_torch": frozenset({"torch_xla", "torchax"}),
    "frontend": frozenset({"torch_xla", "torchax", "jaxlib", "numpy"}),
}
STDLIB = frozenset(sys.stdlib_module_names)
# (module, function) pairs that may import a computed name: torch_xla's untyped modules are
# reached through one helper of the exporter's single door to torch_xla.
DYNAMIC_IMPORT_ALLOWLIST: frozenset[tuple[str, str]] = frozenset(
    {("stepbundle.exporter.xla", "_module")}
)


def package_folders() -> dict[str, Path]:
    """``stepbundle.X`` package name -> its folder, from pyproject.toml's package-dir."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {pkg: ROOT / folder for pkg, folder in mapping.items()}


def modules(folders: Mapping[str, Path] | None = None) -> dict[str, Path]:
    """Every module under the mapped folders, subfolders included: dotted name -> file.

    A subfolder's modules are named as the mapping would install them; whether the
    mapping actually installs them is ``unmapped_subfolders``'s question.
    """
    folders = package_folders() if folders is None else folders
    found: dict[str, Path] = {}
    for pkg, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([pkg, *parts])] = path
    return found


def unmapped_subfolders(folders: Mapping[str, Path] | None = None, root: Path = ROOT) -> list[str]:
    """Subfolders holding .py files that package-dir does not map: missing from the wheel."""
    folders = package_folders() if folders is None else folders
    mapped = {folder.resolve() for folder in folders.values()}
    bad = set()
    for folder in folders.values():
        for path in folder.rglob("*.py"):
            if path.parent.resolve() not in mapped:
                bad.add(path.parent.relative_to(root).as_posix())
    return sorted(bad)


def layer_of(module: str) -> str:
    if module == "stepbundle.__main__":  # `python -m stepbundle` is the command
        return "cli"
    if module == "stepbundle":  # the face; the rest of the package root is version only
        return "face"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "stepbundle"


def _resolve_name(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


@dataclass(frozen=True)
class DynamicImport:
    """An import whose target the source does not spell as a constant string."""

    module: str
    function: str
    """The enclosing function's qualified name, ``<module>`` at the top level."""
    line: int


class _Scanner(ast.NodeVisitor):
    """Collects a module's imports: statements, and calls of the dynamic importers.

    ``importlib.import_module(...)``, ``import_module(...)`` (however imported from
    importlib) and ``__import__(...)`` with a constant string are edges like any import;
    with anything else they are ``DynamicImport`` records. So are the calls of an
    allowlisted helper (its constant arguments are edges; its own body is the exception).
    """

    def __init__(self, module: str, is_package: bool, known: set[str], tree: ast.AST) -> None:
        self.module = module
        self.is_package = is_package
        self.known = known
        self.edges: set[str] = set()
        self.dynamic: list[DynamicImport] = []
        self.functions: list[str] = []
        self.importers = {"__import__"}
        self.importlib_names = {"importlib"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "importlib":
                self.importers.update(
                    a.asname or a.name for a in node.names if a.name in _IMPORTERS
                )
            elif isinstance(node, ast.Import):
                self.importlib_names.update(
                    a.asname for a in node.names if a.name == "importlib" and a.asname
                )
        self.importers.update(f for m, f in DYNAMIC_IMPORT_ALLOWLIST if m == module)

    def visit_Import(self, node: ast.Import) -> None:
        self.edges.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        target = _resolve_name(self.module, self.is_package, node.level, node.module)
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            # `from pkg import submodule` is an edge to the submodule.
            self.edges.add(sub if sub in self.known else target)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def _is_importer(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Name):
            return func.id in self.importers
        return (
            isinstance(func, ast.Attribute)
            and func.attr in _IMPORTERS
            and isinstance(func.value, ast.Name)
            and func.value.id in self.importlib_names | {"builtins"}
        )

    def visit_Call(self, node: ast.Call) -> None:
        if self._is_importer(node.func):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                name = first.value
                level = len(name) - len(name.lstrip("."))
                self.edges.add(
                    _resolve_name(self.module, self.is_package, level, name[level:] or None)
                )
            else:
                where = ".".join(self.functions) or "<module>"
                self.dynamic.append(DynamicImport(self.module, where, node.lineno))
        self.generic_visit(node)


_IMPORTERS = frozenset({"import_module", "__import__"})


def scan(module: str, path: Path, known: Iterable[str]) -> _Scanner:
    tree = ast.parse(path.read_text(), str(path))
    scanner = _Scanner(module, path.stem == "__init__", set(known), tree)
    scanner.visit(tree)
    return scanner


def imports_of(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """Every module name ``module`` imports, anywhere in its body, dynamic imports included."""
    return scan(module, path, known).edges


def dynamic_import_violations(mods: Mapping[str, Path]) -> list[str]:
    """Imports of a computed name, outside the allowlisted helper functions."""
    found = [d for name, path in mods.items() for d in scan(name, path, mods).dynamic]
    return [
        f"{d.module}:{d.line} in {d.function}: import of a computed name"
        for d in sorted(found, key=lambda d: (d.module, d.line))
        if (d.module, d.function) not in DYNAMIC_IMPORT_ALLOWLIST
    ]


def third_party_violations(mods: Mapping[str, Path]) -> list[str]:
    bad = []
    for name, path in mods.items():
        forbidden = FORBIDDEN_THIRD_PARTY.get(layer_of(name), frozenset())
        for imported in imports_of(name, path, mods):
            top = imported.split(".")[0]
            if top in forbidden:
                bad.append(f"{name} imports {imported}")
            if layer_of(name) == "schema" and top not in STDLIB | {"msgpack", "stepbundle", ""}:
                bad.append(f"{name} imports {imported} (the schema is stdlib + msgpack only)")
    return sorted(bad)


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {
        name: {i for i in imports_of(name, path, mods) if i in mods} for name, path in mods.items()
    }


def layer_violations(edges: Mapping[str, Iterable[str]]) -> list[str]:
    bad = []
    for src, targets in edges.items():
        for dst in targets:
            a, b = layer_of(src), layer_of(dst)
            if a != b and b not in ALLOWED[a]:
                bad.append(f"{src} -> {dst} ({a} may not import {b})")
    return sorted(bad)


# The runtime's rooms, lowest first: a room imports the base modules and the rooms before
# it, never one after it nor the face (``load.py``, ``options.py``, the package itself),
# which may import them all. The base modules import only each other.
RUNTIME_ROOMS = ("io", "placement", "data", "compile", "state", "train")
RUNTIME_BASE = frozenset({"errors", "dtypes", "fallback", "_compat"})


def runtime_room(module: str) -> str | None:
    """``"base"``, a room's name, ``"face"``, or None outside the runtime."""
    parts = module.split(".")
    if parts[:2] != ["stepbundle", "runtime"]:
        return None
    if len(parts) > 2 and parts[2] in RUNTIME_ROOMS:
        return parts[2]
    if len(parts) > 2 and parts[2] in RUNTIME_BASE:
        return "base"
    return "face"


def room_violations(edges: Mapping[str, Iterable[str]]) -> list[str]:
    bad = []
    for src, targets in edges.items():
        a = runtime_room(src)
        if a is None or a == "face":
            continue
        for dst in targets:
            b = runtime_room(dst)
            if b is None or b == a or b == "base":
                continue
            if a == "base" or b == "face" or RUNTIME_ROOMS.index(b) > RUNTIME_ROOMS.index(a):
                bad.append(f"{src} -> {dst} (runtime room {a} may not import {b})")
    return sorted(bad)


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_folder_of_the_mapping_is_a_layer() -> None:
    # the root folder's layer is "stepbundle" (the version); its own module is the face
    layers = {layer_of(f"{pkg}._any") for pkg in package_folders()}
    assert layers | {"face"} == set(ALLOWED)
    assert not (ROOT / "stepbundle").exists(), "a top-level stepbundle/ would shadow the package"


def test_no_import_crosses_layers_the_wrong_way() -> None:
    assert layer_violations(graph()) == []


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_exporter_and_the_runtime_do_not_import_each_other() -> None:
    edges = graph()
    for src, targets in edges.items():
        for dst in targets:
            assert {layer_of(src), layer_of(dst)} != {"exporter", "runtime"}, (src, dst)


def test_third_party_imports_stay_in_their_layer() -> None:
    assert third_party_violations(modules()) == []


def test_no_import_of_a_computed_name() -> None:
    mods = modules()
    assert dynamic_import_violations(mods) == []
    for module, function in DYNAMIC_IMPORT_ALLOWLIST:  # the allowlist names real code
        tree = ast.parse(mods[module].read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in defined, (module, function)


def test_every_folder_with_modules_is_mapped() -> None:
    assert unmapped_subfolders() == [], (
        "these folders hold modules that pyproject.toml's package-dir does not map, so the "
        "wheel would not contain them: map them (and list them in packages) or move the files"
    )


def test_the_front_end_core_and_the_torch_front_end_never_reach_torch_xla() -> None:
    # Neither may import the torch_xla front-end (the layer rules), nor torch_xla itself
    # (the third-party rules); the checker must see both kinds of edge.
    edges = {k: set(v) for k, v in graph().items()}
    edges["stepbundle.export_torch.export"].add("stepbundle.exporter.workspace")
    edges["stepbundle.frontend.dtypes"].add("stepbundle.exporter.xla")
    assert layer_violations(edges) == [
        "stepbundle.export_torch.export -> stepbundle.exporter.workspace (export_torch may not "
        "import exporter)",
        "stepbundle.frontend.dtypes -> stepbundle.exporter.xla (frontend may not import exporter)",
    ]
    assert FORBIDDEN_THIRD_PARTY["frontend"] >= {"torch_xla"}
    assert FORBIDDEN_THIRD_PARTY["export_torch"] >= {"torch_xla"}


def test_the_checker_sees_a_forbidden_edge_and_a_cycle() -> None:
    # The checks above pass on the real tree; here they must fail on trees that break
    # each rule, or passing would mean nothing.
    edges = {k: set(v) for k, v in graph().items()}
    edges["stepbundle.exporter.export"].add("stepbundle.runtime.load")
    assert layer_violations(edges) == [
        "stepbundle.exporter.export -> stepbundle.runtime.load (exporter may not import runtime)"
    ]
    edges = {k: set(v) for k, v in graph().items()}
    edges["stepbundle.schema.errors"].add("stepbundle.schema.manifest")
    edges["stepbundle.schema.manifest"].add("stepbundle.schema.errors")
    assert ["stepbundle.schema.errors", "stepbundle.schema.manifest"] in cycles(edges)


def test_the_runtime_rooms_import_downwards_only() -> None:
    folders = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(RUNTIME_ROOMS)
    assert room_violations(graph()) == []


def test_the_checker_sees_a_room_edge_the_wrong_way() -> None:
    edges = {k: set(v) for k, v in graph().items()}
    edges["stepbundle.runtime.io.store"].add("stepbundle.runtime.compile.compile_cache")
    edges["stepbundle.runtime.errors"].add("stepbundle.runtime.train.metrics")
    edges["stepbundle.runtime.train.trainer"].add("stepbundle.runtime.load")
    assert room_violations(edges) == [
        "stepbundle.runtime.errors -> stepbundle.runtime.train.metrics"
        " (runtime room base may not import train)",
        "stepbundle.runtime.io.store -> stepbundle.runtime.compile.compile_cache"
        " (runtime room io may not import compile)",
        "stepbundle.runtime.train.trainer -> stepbundle.runtime.load"
        " (runtime room train may not import face)",
    ]


def test_lazy_imports_are_edges(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from stepbundle.runtime import load\n    from . import x\n")
    found = imports_of("stepbundle.exporter.mod", path, {"stepbundle.exporter.x"})
    assert found == {"stepbundle.runtime", "stepbundle.exporter.x"}


def test_the_checker_sees_constant_dynamic_imports(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text(
        "import importlib\n"
        "from importlib import import_module as im\n"
        "def f():\n"
        "    importlib.import_module('stepbundle.runtime.load')\n"
        "    im('stepbundle.runtime.train.trainer')\n"
        "    __import__('stepbundle.runtime.train.plan')\n"
        "    importlib.import_module('.x', __package__)\n"
    )
    mods = {"stepbundle.exporter.mod": path, "stepbundle.exporter.x": path}
    found = imports_of("stepbundle.exporter.mod", path, mods)
    assert found >= {
        "stepbundle.runtime.load",
        "stepbundle.runtime.train.trainer",
        "stepbundle.runtime.train.plan",
        "stepbundle.exporter.x",
    }
    assert dynamic_import_violations({"stepbundle.exporter.mod": path}) == []
    edges = {"stepbundle.exporter.mod": found}
    assert layer_violations(edges) == [
        f"stepbundle.exporter.mod -> stepbundle.runtime.{m} (exporter may not import runtime)"
        for m in ("load", "train.plan", "train.trainer")
    ]


def test_the_checker_sees_computed_dynamic_imports(tmp_path: Path) -> None:
    path = tmp_path / "xla.py"
    path.write_text(
        "import importlib\n"
        "def _module(name):\n"
        "    return importlib.import_module(name)\n"
        "def other(name):\n"
        "    __import__(name)\n"
        "    _module(name)\n"
        "    return _module('stepbundle.runtime.load')\n"
        "class C:\n"
        "    def _module(self, name):\n"
        "        return importlib.import_module(name)\n"
    )
    # The allowlisted helper is allowed by module and function name, nothing else is.
    assert dynamic_import_violations({"stepbundle.exporter.xla": path}) == [
        "stepbundle.exporter.xla:5 in other: import of a computed name",
        "stepbundle.exporter.xla:6 in other: import of a computed name",
        "stepbundle.exporter.xla:10 in C._module: import of a computed name",
    ]
    # The helper's constant arguments are edges.
    assert "stepbundle.runtime.load" in imports_of("stepbundle.exporter.xla", path, ())
    # The same helper in another module is not allowlisted.
    assert dynamic_import_violations({"stepbundle.exporter.trace": path}) == [
        "stepbundle.exporter.trace:3 in _module: import of a computed name",
        "stepbundle.exporter.trace:5 in other: import of a computed name",
        "stepbundle.exporter.trace:10 in C._module: import of a computed name",
    ]


def test_the_checker_sees_an_unmapped_subfolder(tmp_path: Path) -> None:
    (tmp_path / "runtime" / "sub").mkdir(parents=True)
    (tmp_path / "runtime" / "a.py").write_text("")
    (tmp_path / "runtime" / "sub" / "__init__.py").write_text("")
    (tmp_path / "runtime" / "sub" / "b.py").write_text("import torch\n")
    (tmp_path / "runtime" / "data").mkdir()  # no modules: not a package, not a problem
    folders = {"stepbundle.runtime": tmp_path / "runtime"}
    assert unmapped_subfolders(folders, tmp_path) == ["runtime/sub"]
    mods = modules(folders)
    assert set(mods) == {
        "stepbundle.runtime.a",
        "stepbundle.runtime.sub",
        "stepbundle.runtime.sub.b",
    }
    assert third_party_violations(mods) == ["stepbundle.runtime.sub.b imports torch"]
    folders["stepbundle.runtime.sub"] = tmp_path / "runtime" / "sub"
    assert unmapped_subfolders(folders, tmp_path) == []


def test_the_checker_sees_safetensors_in_the_runtime_and_stablehlo(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from safetensors.numpy import load_file\n")
    mods = {f"stepbundle.{layer}.mod": path for layer in ("runtime", "stablehlo", "exporter")}
    assert third_party_violations(mods) == [
        "stepbundle.runtime.mod imports safetensors.numpy",
        "stepbundle.stablehlo.mod imports safetensors.numpy",
    ]
