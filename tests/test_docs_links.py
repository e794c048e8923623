"""Every path, module and link the documentation names exists in this repository.

The pages checked are README.md, docs/*.md, benchmarks/README.md and schema/FORMAT.md.
In each page:

- a relative Markdown link (``[text](target)``) resolves, from the page's folder, to a
  file or folder inside the repository;
- a file path (``runtime/data/loader.py``, ``tests/golden/v1.0/``) whose first part is a
  top-level entry of the repository (or of the page's own folder), and any path ending
  in ``.py``, exists;
- a dotted module name (``stepbundle.runtime.data.dataset_writer``, with an optional last
  part that names something the module defines: ``...dataset_writer.write_dataset``)
  resolves to a module file or package folder through pyproject.toml's package-dir
  mapping;
- in a layout table row that starts with a folder (``| `runtime/` | ...``), every bare
  ``name.py`` named in the row is a file of that folder;
- nothing points outside the repository: no ``../shared``, no ``/work/`` path, and no
  file that lives beside the repository rather than in it (DESIGN.md, HOUSE_STYLE.md).

Paths under build/ and the virtual environments are outputs, not sources, and are not
checked; nor are third-party paths quoted in error messages (``transformers/...``), nor
the paths docs/layout.md proposes (``PROPOSED``).
The test reads the checkout only; it needs nothing installed.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent

# Files and folders that a checkout has but the repository does not track.
UNTRACKED = frozenset(
    {
        ".git",
        ".venv",
        ".venv-lean",
        ".venv-torch",
        "build",
        "dist",
        "out",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        ".hypothesis",
        "__pycache__",
    }
)
# Top-level names of other projects' source trees, quoted in error messages.
THIRD_PARTY = frozenset(
    {"transformers", "torch", "torch_xla", "torchvision", "jax", "jaxlib", "setuptools"}
)
# Paths a page proposes rather than names: docs/layout.md weighs moving the package under
# src/stepbundle/. Remove its entry when the move is made (the page changes with it).
PROPOSED = {"docs/layout.md": ("src/", "stepbundle/")}
# Text that points outside the repository: the design notes and house style live in a
# folder beside it, which a reader of the repository does not have.
OUTSIDE = ("../shared", "/work/", "DESIGN.md", "HOUSE_STYLE.md")

LINK = re.compile(r"\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
DOTTED = re.compile(r"(?<![\w./-])stepbundle(?:\.[A-Za-z_]\w*)+")
# Dotted names that are not modules: the attention composites' operation names
# (stablehlo/attention_composite.py NAME and GRAD_NAME).
NOT_MODULES = {"stepbundle.attention", "stepbundle.attention_grad"}
# A token is cut at whitespace and at characters no path here contains.
SEPARATORS = re.compile(r"[\s`'\"()\[\]{},;:=|!?]+")
SKIP_TOKEN = re.compile(r"[<>*$~…@%^#]|\.\.\.")
TABLE_FOLDER_ROW = re.compile(r"^\|\s*`([\w./-]+/)`\s*\|(.*)$", re.M)
BARE_PY = re.compile(r"(?<![\w./-])([A-Za-z_]\w*\.py)\b")


def pages() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found += [ROOT / "benchmarks" / "README.md", ROOT / "schema" / "FORMAT.md"]
    return [p for p in found if p.is_file()]


def package_dirs() -> dict[str, Path]:
    """Dotted package name -> its folder, from pyproject.toml's package-dir mapping."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def defined_names(module: Path) -> set[str]:
    """Names a module binds at its top level (functions, classes, assignments, imports)."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return names


def resolve_module(dotted: str, dirs: dict[str, Path]) -> str | None:
    """None if ``dotted`` names a module, package or a name one defines; else why not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        if ".".join(parts[:cut]) in dirs:
            folder, rest = dirs[".".join(parts[:cut])], parts[cut:]
            break
    else:
        return "no package-dir entry maps its package"
    module = folder / "__init__.py"
    for i, part in enumerate(rest):
        if module.name == "__init__.py" and (folder / part / "__init__.py").is_file():
            folder, module = folder / part, folder / part / "__init__.py"
        elif module.name == "__init__.py" and (folder / f"{part}.py").is_file():
            module = folder / f"{part}.py"
        elif part in defined_names(module):
            return None  # a name the module defines; what follows is its attribute
        else:
            name = ".".join(parts[: len(parts) - len(rest) + i + 1])
            return f"{name} is not a module, package or name of {module.relative_to(ROOT)}"
    return None


def path_tokens(text: str) -> Iterator[str]:
    for raw in SEPARATORS.split(LINK.sub(lambda m: m.group(0).split("](")[0] + "]", text)):
        token = raw.rstrip(".,")
        if token.endswith("'s"):
            token = token[:-2]
        if "/" not in token and not token.endswith(".py"):
            continue
        if not token or SKIP_TOKEN.search(token) or token.startswith(("/", "-")):
            continue
        yield token


def path_problem(token: str, page: Path) -> str | None:
    first = token.split("/")[0]
    if first in UNTRACKED or first in THIRD_PARTY:
        return None
    if token.startswith(PROPOSED.get(page.relative_to(ROOT).as_posix(), ())):
        return None
    if "/" not in token:
        return None  # a bare name.py: checked in folder rows only
    top = {p.name for p in ROOT.iterdir()} - UNTRACKED
    local = {p.name for p in page.parent.iterdir()} - UNTRACKED
    if first not in top and first not in local and not token.endswith(".py"):
        return None  # not a repository path (`runs/a`, `ckpt/step-N.safetensors`)
    if (ROOT / token).exists() or (page.parent / token).exists():
        return None
    return f"{token} does not exist"


def problems(page: Path) -> list[str]:
    text = page.read_text()
    rel = page.relative_to(ROOT)
    found: list[str] = []
    for marker in OUTSIDE:
        for m in re.finditer(re.escape(marker), text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{rel}:{line}: {marker!r} points outside the repository")
    for m in [*LINK.finditer(text), *REF_LINK.finditer(text)]:
        target = m.group(1)
        if SCHEME.match(target) or target.startswith("#"):
            continue
        line = text.count("\n", 0, m.start()) + 1
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.is_relative_to(ROOT):
            found.append(f"{rel}:{line}: link {target} leaves the repository")
        elif not path.exists():
            found.append(f"{rel}:{line}: link {target} does not exist")
    for token in sorted(set(path_tokens(text))):
        why = path_problem(token, page)
        if why:
            found.append(f"{rel}: {why}")
    dirs = package_dirs()
    for dotted in sorted(set(DOTTED.findall(text)) - NOT_MODULES):
        why = resolve_module(dotted, dirs)
        if why:
            found.append(f"{rel}: {dotted}: {why}")
    for m in TABLE_FOLDER_ROW.finditer(text):
        folder = (
            page.parent / m.group(1) if (page.parent / m.group(1)).is_dir() else ROOT / m.group(1)
        )
        for name in sorted(set(BARE_PY.findall(m.group(2)))):
            if not (folder / name).is_file():
                found.append(f"{rel}: the {m.group(1)} row names {name}, not a file of that folder")
    return found


def test_the_pages_exist() -> None:
    assert ROOT / "README.md" in pages()
    assert ROOT / "schema" / "FORMAT.md" in pages()


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_module_and_link_exists(page: Path) -> None:
    found = problems(page)
    assert not found, "\n".join(found)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = {(ROOT / m.group(1).split("#")[0]).resolve() for m in LINK.finditer(readme)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in targets]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_checker_sees_what_it_must(tmp_path: Path) -> None:
    """The checks have teeth: each kind of stale reference is reported."""
    dirs = package_dirs()
    assert resolve_module("stepbundle.runtime.data.dataset_writer.write_dataset", dirs) is None
    assert resolve_module("stepbundle.runtime.load", dirs) is None
    assert resolve_module("stepbundle.schema.describe", dirs) is None
    assert resolve_module("stepbundle.runtime.mlir.ALLOWED_CUSTOM_CALLS", dirs) is not None
    assert resolve_module("stepbundle.nonexistent", dirs) is not None
    page = ROOT / "README.md"
    assert path_problem("runtime/data/loader.py", page) is None
    assert path_problem("runtime/no_such_module.py", page) is not None
    assert path_problem("no_such_folder/module.py", page) is not None
    assert path_problem("ckpt/step-00000500.safetensors", page) is None
    tokens = set(
        path_tokens("see `runtime/data/loader.py`'s docstring and (tests/frontend_torch).")
    )
    assert tokens == {"runtime/data/loader.py", "tests/frontend_torch"}


SOURCE_DIRS = (
    "schema",
    "stablehlo",
    "exporter",
    "runtime",
    "cli",
    "frontend_core",
    "frontend_torch",
    "scripts",
    "benchmarks",
    "examples",
)
_SOURCE_PATH = re.compile(
    r"(?<![\w/.])((?:" + "|".join(SOURCE_DIRS + ("tests", "docs", "package")) + r")/"
    r"[\w/.-]*\w\.(?:py|md|sh|json|toml))"
)


def test_every_repository_file_a_docstring_or_comment_names_exists() -> None:
    """Source files name each other in docstrings and comments (``frontend_core/
    initial_state.py``); a moved file must not leave its old path behind."""
    stale = [
        f"{f.relative_to(ROOT)}:{n}: {m.group(1)}"
        for d in SOURCE_DIRS
        for f in sorted((ROOT / d).rglob("*.py"))
        for n, line in enumerate(f.read_text().splitlines(), 1)
        for m in _SOURCE_PATH.finditer(line)
        if not (ROOT / m.group(1)).exists()
    ]
    assert not stale, "\n".join(stale)
