"""Passes over the captured aten graph: what it writes, what it reads, how to compare two.

The capture is functional: an in-place update of an input (the optimizer's ``add_`` on
a parameter, BatchNorm's running statistics) ends the graph as ``copy_(input, value)``,
which is how this front-end learns, structurally, which inputs a step writes.
``split_mutations`` takes those nodes out and returns them.

Imports: torch.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import fx

__all__ = [
    "canonical",
    "constants",
    "first_difference",
    "graph_text",
    "placeholders",
    "random_nodes",
    "reads_value",
    "split_mutations",
    "strip_profiler",
]

aten = torch.ops.aten

# Operators whose result is their input (the functional graph's views and copies).
_SAME_VALUE = {
    aten.alias.default,
    aten.clone.default,
    aten.alias_copy.default,
    aten.detach.default,
    aten.detach_copy.default,
    aten.lift_fresh_copy.default,
}
# Operators that read only their first argument's shape and dtype, never its values.
_SHAPE_ONLY = {
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
}
_RANDOM_TAG = torch.Tag.nondeterministic_seeded


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def strip_profiler(gm: fx.GraphModule) -> None:
    """Remove ``torch.profiler`` bookkeeping nodes (``record_function`` ranges)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and getattr(node.target, "namespace", "") == "profiler":
            for user in list(node.users):
                gm.graph.erase_node(user)
            gm.graph.erase_node(node)
    gm.recompile()


def split_mutations(gm: fx.GraphModule) -> dict[int, fx.Node]:
    """Take out the trailing ``copy_(input, value)`` nodes: input index -> its new value.

    Raises:
      ValueError: a mutation of something that is not an input, or another in-place
        operator, is left in the graph (the capture did not functionalize it).
    """
    index = {n: i for i, n in enumerate(placeholders(gm))}
    writes: dict[int, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is aten.copy_.default:
            dst, value = node.args[0], node.args[1]
            if dst not in index:
                raise ValueError(f"{node.format_node()} writes to {dst}, which is not an input")
            writes[index[dst]] = value
            gm.graph.erase_node(node)
        elif node.target._schema.is_mutable:
            raise ValueError(f"{node.format_node()} is an in-place operator")
    gm.recompile()
    return writes


def canonical(node: Any) -> Any:
    """The node whose value ``node`` has, through aliases and clones."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _SAME_VALUE:
        node = node.args[0]
    return node


def reads_value(node: fx.Node) -> bool:
    """Whether an operator of the graph reads ``node``'s values (not only its shape).

    The graph's outputs do not count: whether an output that *is* an input reads it
    (a metric that returns an input) is for the caller to say.
    """
    for user in node.users:
        if user.op == "output":
            continue
        if user.op == "call_function" and user.target in _SHAPE_ONLY and user.args[0] is node:
            if any(a is node for a in (*user.args[1:], *user.kwargs.values())):
                return True
            continue
        if user.op == "call_function" and user.target in _SAME_VALUE:
            if reads_value(user):
                return True
            continue
        return True
    return False


def random_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes that draw random numbers, in program order."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and _RANDOM_TAG in n.target.tags
        and not _no_dropout(n)
    ]


def _no_dropout(node: fx.Node) -> bool:
    """True for an operator tagged as random only for its dropout (the SDPA kernels)
    called with ``dropout_p`` 0: it draws nothing, so the step needs no seed for it."""
    assert isinstance(node.target, torch._ops.OpOverload)
    names = [a.name for a in node.target._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    if i < len(node.args):
        p = node.args[i]
    else:
        default = node.target._schema.arguments[i].default_value
        p = node.kwargs.get("dropout_p", default)
    return isinstance(p, (int, float)) and float(p) == 0.0


def graph_text(gm: fx.GraphModule) -> str:
    """The graph as text, for comparing two captures (node names, operators, arguments)."""
    return str(gm.graph)


def first_difference(a: str, b: str) -> str:
    """The first line where two graph texts differ, for an error message."""
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}:\n  step 1: {x.strip()[:300]}\n  step 2: {y.strip()[:300]}"
    diff = list(difflib.unified_diff(la, lb, lineterm="", n=0))
    return "\n".join(diff[:6])


def constants(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The tensors the graph holds as attributes (tensors the step captured from Python)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor):
                out[node.target] = value
    return out
