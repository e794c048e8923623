"""Imports go one way: the declared layers, no cycles, no undeclared edges.

The picture (an arrow reads "may import"):

    cli ──▶ exporter ──▶ stablehlo ──▶ schema ──▶ stepbundle (the package root: version only)
     │  └─▶ runtime  ──▶ stablehlo
     └────────────────────────────────▶ schema

The exporter and the runtime never import each other. Every import counts, including
those inside functions (a lazy import is still an edge, and a lazy cycle is still a
cycle). The graph is read from the source with ``ast``, following pyproject.toml's
package-dir mapping, so the test needs nothing installed and sees exactly the checkout.
Third-party rules ride along: the schema imports the standard library and msgpack only,
the runtime and the StableHLO module never import torch.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent

# layer -> the layers it may import (itself always allowed).
ALLOWED: dict[str, frozenset[str]] = {
    "stepbundle": frozenset(),
    "schema": frozenset({"stepbundle"}),
    "stablehlo": frozenset({"stepbundle", "schema"}),
    "runtime": frozenset({"stepbundle", "schema", "stablehlo"}),
    "exporter": frozenset({"stepbundle", "schema", "stablehlo"}),
    "cli": frozenset({"stepbundle", "schema", "stablehlo", "runtime", "exporter"}),
}
# layer -> third-party top-level modules it must never import.
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "schema": frozenset({"torch", "torch_xla", "jax", "jaxlib", "numpy", "safetensors"}),
    "stablehlo": frozenset({"torch", "torch_xla", "numpy"}),
    "runtime": frozenset({"torch", "torch_xla", "torchvision", "transformers"}),
    "stepbundle": frozenset({"torch", "torch_xla", "jax", "jaxlib", "numpy"}),
}
STDLIB = frozenset(sys.stdlib_module_names)


def package_folders() -> dict[str, Path]:
    """``stepbundle.X`` package name -> its folder, from pyproject.toml's package-dir."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {pkg: ROOT / folder for pkg, folder in mapping.items()}


def modules() -> dict[str, Path]:
    """Every module of the installed package: dotted name -> file."""
    found: dict[str, Path] = {}
    for pkg, folder in package_folders().items():
        for path in sorted(folder.glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            found[name] = path
    return found


def layer_of(module: str) -> str:
    if module == "stepbundle.__main__":  # `python -m stepbundle` is the command
        return "cli"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "stepbundle"


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """Every module name ``module`` imports, anywhere in its body."""
    known = set(known)
    is_package = path.stem == "__init__"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                # `from pkg import submodule` is an edge to the submodule.
                out.add(sub if sub in known else target)
    return out


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
    assert set(map(layer_of, package_folders())) == set(ALLOWED)
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
    mods = modules()
    bad = []
    for name, path in mods.items():
        forbidden = FORBIDDEN_THIRD_PARTY.get(layer_of(name), frozenset())
        for imported in imports_of(name, path, mods):
            top = imported.split(".")[0]
            if top in forbidden:
                bad.append(f"{name} imports {imported}")
            if layer_of(name) == "schema" and top not in STDLIB | {"msgpack", "stepbundle", ""}:
                bad.append(f"{name} imports {imported} (the schema is stdlib + msgpack only)")
    assert bad == []


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


def test_lazy_imports_are_edges(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from stepbundle.runtime import load\n    from . import x\n")
    found = imports_of("stepbundle.exporter.mod", path, {"stepbundle.exporter.x"})
    assert found == {"stepbundle.runtime", "stepbundle.exporter.x"}
