"""What changed between two traces of one step whose graphs differ, said in its terms.

A step whose graph changes from one traced call to the next cannot be one program. The
refusal says what changed: the metric keys, the graph's input and output tables (which
state, batch or Python value each input is), and the first op that differs, with the
Python source location torch_xla recorded for it (its IR metadata, present when the
traces ran under ``xla.ir_debug()``; the exporter traces again so to explain a refusal).
Without IR, the first differing StableHLO op of the function body is shown.

Imports: torch (for types), the exporter's trace records.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence

import torch

from stepbundle.frontend.errors import ExportError

from . import xla
from .trace import InputOrigin, StepTrace

__all__ = ["describe_change", "explain_graph_change", "first_ir_difference"]

_MAX_ROWS = 5
_IR_NODE = re.compile(r"^\s*%(\d+) = (\S+) ([\w:.]+)\((.*?)\)(.*)$")


def _spec(dtype: torch.dtype, shape: Sequence[int]) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _input(o: InputOrigin) -> str:
    spec = _spec(o.dtype, o.shape)
    if o.kind == "state":
        return f"state {o.name!r} ({spec})"
    if o.kind == "batch":
        return f"batch {o.name!r} ({spec})"
    if o.kind == "hyperparameter":
        return f"hyperparameter {o.name!r} ({spec})"
    if o.kind == "rng_seed":
        return f"the RNG seed ({spec})"
    return f"a value captured from Python or made inside the step ({spec})"


def _outputs(t: StepTrace) -> list[str]:
    out = [f"metric {n!r} ({_spec(*s)})" for n, s in zip(t.metric_names, t.metric_specs)]
    out += [f"state update {n!r} ({_spec(*s)})" for n, s in zip(t.updated_state, t.update_specs)]
    return out


def _table_diff(table: str, a: list[str], b: list[str]) -> list[str]:
    rows = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag in ("delete", "replace"):
            rows += [f"{table} {i}: {a[i]} in step 1, not in step 2" for i in range(i1, i2)]
        if tag in ("insert", "replace"):
            rows += [f"{table} {j}: {b[j]} in step 2, not in step 1" for j in range(j1, j2)]
    if len(rows) > _MAX_ROWS:
        rows = rows[:_MAX_ROWS] + [f"... {len(rows) - _MAX_ROWS} more {table} differences"]
    return rows


def _ir_nodes(ir: str) -> list[tuple[str, str]]:
    """The IR's computing nodes as (what it computes, where), in graph order.

    Graph inputs (``xla::device_data``) are left out (the input table shows them) and
    operands are renumbered over the computing nodes, so that an extra input does not
    make every later node differ.
    """
    nodes: list[tuple[str, str]] = []
    renamed: dict[str, str] = {}
    for line in ir.splitlines():
        m = _IR_NODE.match(line)
        if m is None:
            continue
        nid, shape, op, args, attrs = m.groups()
        if op == "xla::device_data":
            renamed[nid] = "input"
            continue
        renamed[nid] = f"%{len(nodes)}"
        args = re.sub(r"%(\d+)", lambda r: renamed.get(r.group(1), r.group(0)), args)
        where = re.search(r"location=([^,]+)", attrs)
        nodes.append((f"{shape} {op}({args})", where.group(1) if where else ""))
    return nodes


def first_ir_difference(ir_a: str, ir_b: str) -> str | None:
    """The first computing IR node that differs between two traces, with torch_xla's
    source location of each."""
    a, b = _ir_nodes(ir_a), _ir_nodes(ir_b)
    if not a or not b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x[0] != y[0]:
            return f"first differing op (op {i}): step 1 {_at(x)}; step 2 {_at(y)}"
    if len(a) != len(b):
        longer, n = (a, 1) if len(a) > len(b) else (b, 2)
        return (
            f"step {n} has {abs(len(a) - len(b))} more op(s), the first "
            f"{_at(longer[min(len(a), len(b))])}"
        )
    return None


def _at(node: tuple[str, str]) -> str:
    what, where = node
    return f"computes {what} at {where}" if where else f"computes {what}"


def _first_stablehlo_difference(a: str, b: str) -> str | None:
    """The first differing op of the StableHLO function bodies, constants aside (they
    are hoisted to the top of the body; the first differing constant when only they
    differ). Value names are left out: they shift after the first difference."""

    def body(text: str) -> list[str]:
        lines = text.splitlines()
        start = next((i for i, ln in enumerate(lines) if "func.func" in ln), -1)
        return [ln.strip() for ln in lines[start + 1 :]]

    def ops(lines: list[str], constants: bool) -> list[tuple[str, str]]:
        return [
            (re.sub(r"%[\w#]+", "%", ln), ln)
            for ln in lines
            if ("stablehlo.constant" in ln) == constants
        ]

    la, lb = body(a), body(b)
    for constants in (False, True):
        oa, ob = ops(la, constants), ops(lb, constants)
        what = "constant" if constants else "op"
        for i, (x, y) in enumerate(zip(oa, ob)):
            if x[0] != y[0]:
                return (
                    f"first differing StableHLO {what} ({what} {i + 1} of @main):\n"
                    f"      step 1: {x[1][:200]}\n      step 2: {y[1][:200]}"
                )
        if len(oa) != len(ob):
            longer, n = (oa, 1) if len(oa) > len(ob) else (ob, 2)
            return (
                f"step {n} has {abs(len(oa) - len(ob))} more StableHLO {what}(s), the first: "
                f"{longer[min(len(oa), len(ob))][1][:200]}"
            )
    return None


def _changed_settings(ta: StepTrace, tb: StepTrace) -> list[str]:
    """Optimizer settings that changed between the traces: torch bakes them into the graph
    as numbers (or, for some values, as other ops), so they change it."""
    after = dict(tb.hyper_values)
    changed = [(k, v, after[k]) for k, v in ta.hyper_values if k in after and after[k] != v]
    if not changed:
        return []
    keys = []
    for label, _, _ in changed:
        key, tail = label.split("'")[1], label.split("'")[-1]
        keys.append(f"{key}.{tail[2:-1]}" if tail.startswith("][") else key)
    shown = ", ".join(f"{k} from {a:.6g} to {b:.6g}" for k, a, b in changed[:_MAX_ROWS])
    return [
        f"optimizer settings changed between the steps: {shown} (a scheduler stepped "
        "inside the step, or other code that edits param_groups). Declare them, "
        f"Recipe(hyperparameters={tuple(dict.fromkeys(keys))!r}), and set them from the "
        "runtime (trainer.set_schedule, stepbundle run --lr-schedule NAME=SPEC) instead"
    ]


def describe_change(ta: StepTrace, tb: StepTrace) -> str:
    """What differs between two traces whose graphs differ, one item a line."""
    rows = []
    if ta.metric_names != tb.metric_names:
        rows.append(
            f"metric keys: {list(ta.metric_names)} in step 1, {list(tb.metric_names)} in step 2"
        )
    rows += _changed_settings(ta, tb)
    rows += _table_diff("input", [_input(o) for o in ta.inputs], [_input(o) for o in tb.inputs])
    rows += _table_diff("output", _outputs(ta), _outputs(tb))
    op = first_ir_difference(ta.ir, tb.ir) if ta.ir and tb.ir else None
    if op is None:
        op = _first_stablehlo_difference(ta.text, tb.text)
    if op is not None:
        rows.append(op)
    if not rows:  # pragma: no cover - equal tables and bodies mean equal text
        rows.append("the graphs' texts differ outside their tables and bodies")
    return "".join(f"\n  - {r}" for r in rows)


def explain_graph_change(e: ExportError, retrace: Callable[[], object]) -> None:
    """Raise the refusal ``e`` (a ``bind.GraphChanged``), with torch_xla's source
    locations when it has none: ``retrace`` traces the recipe again under
    ``xla.ir_debug()``, and its refusal names them. The first one is raised when the
    change does not recur (the step behaved otherwise the second time)."""
    if getattr(e, "located", True):
        raise e
    try:
        with xla.ir_debug():
            retrace()
    except ExportError as located:
        if getattr(located, "located", False):
            raise located from None
    except Exception:  # noqa: S110 - any other failure: the first answer stands
        pass
    raise e
