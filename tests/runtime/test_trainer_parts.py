"""``Trainer`` is composed of parts that own their attributes, not mixins that share them.

Read from the source with ``ast`` (nothing imported): a runtime class may not declare
attributes it never sets (the mixin pattern: ``_state: list[Any]`` in a class body that
some other class fills in), and ``Trainer`` inherits from nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
# Classes whose bare annotations are fields, not borrowed attributes.
RECORD_BASES = {"TypedDict", "Protocol", "NamedTuple", "Enum"}


def _is_record(cls: ast.ClassDef) -> bool:
    decorators = {ast.unparse(d).split("(")[0].split(".")[-1] for d in cls.decorator_list}
    bases = {ast.unparse(b).split(".")[-1] for b in cls.bases}
    return "dataclass" in decorators or bool(bases & RECORD_BASES)


def test_no_runtime_class_declares_attributes_it_does_not_set() -> None:
    borrowed = []
    for path in sorted(RUNTIME.glob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef) or _is_record(cls):
                continue
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and stmt.value is None:
                    borrowed.append(f"{path.name}:{cls.name}.{ast.unparse(stmt.target)}")
    assert borrowed == [], (
        "these classes declare attributes that another class sets (a mixin); give the "
        f"attribute to the part that owns it and pass the part instead: {borrowed}"
    )


def test_trainer_inherits_from_nothing() -> None:
    tree = ast.parse((RUNTIME / "train" / "trainer.py").read_text())
    (trainer,) = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "Trainer"]
    assert trainer.bases == []
