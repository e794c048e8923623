"""Calls of a module's private functions replaced by the functions' bodies.

A normalization, not an optimization: XLA inlines every call when it compiles, so the
values a program computes do not change. A pattern matcher that reads operations one
by one (``attention.py``) sees the same graph however a front-end split it into
functions: the torch front-end wrote ``torch.where`` as ``call @_where_N(...)``, one
function per shape, before 7013169, where torch_xla writes the ``select`` itself.

Functions named ``stepbundle_*`` (the fused kernels a rewrite moved in) keep their
calls. A callee is inlined only when none of its nested regions reads a value defined
outside that region (a ``reduce``'s body reads its own arguments only): such a value would
need remapping that operation cloning does not do.

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

from typing import Any

from jaxlib.mlir import ir

from .artifact import Module

__all__ = ["KEPT_PREFIX", "inline_private_calls"]


KEPT_PREFIX = "stepbundle_"
"""Functions the runtime moved in (the fused kernels, ``graph.insert_functions``) keep
their calls: a rewrite found them by their calls, and they are large."""


def _private_functions(module: Module) -> dict[str, Any]:
    found = {}
    for op in module._module.body.operations:
        if op.operation.name != "func.func" or "sym_visibility" not in op.attributes:
            continue
        if ir.StringAttr(op.attributes["sym_visibility"]).value != "private":
            continue
        if not op.regions[0].blocks:  # a declaration
            continue
        name = ir.StringAttr(op.attributes["sym_name"]).value
        if not name.startswith(KEPT_PREFIX):
            found[name] = op.operation
    return found


def _inlinable(func: Any) -> bool:
    """No operation inside a nested region reads a value of the function's own body
    (its arguments or its top-level results)."""
    block = func.regions[0].blocks[0]
    top = {a for a in block.arguments}
    for op in block.operations:
        top.update(op.results)
    stack = [r for op in block.operations for r in op.operation.regions]
    while stack:
        region = stack.pop()
        for inner_block in region.blocks:
            for op in inner_block.operations:
                if any(v in top for v in op.operands):
                    return False
                stack.extend(op.operation.regions)
    return True


def _inline_one(call: Any, func: Any) -> None:
    block = func.regions[0].blocks[0]
    mapping: dict[Any, Any] = dict(zip(block.arguments, call.operands))
    results: list[Any] = []
    ip = ir.InsertionPoint(call)
    for op in block.operations:
        op = op.operation
        if op.name == "func.return":
            results = [mapping.get(v, v) for v in op.operands]
            break
        new = op.clone(ip=ip)
        for i, v in enumerate(op.operands):
            if v in mapping:
                new.operands[i] = mapping[v]
        for old, made in zip(op.results, new.results):
            mapping[old] = made
    for old, value in zip(call.results, results):
        old.replace_all_uses_with(value)
    call.erase()


def inline_private_calls(module: Module) -> int:
    """Replace every ``func.call`` of a private function defined in ``module`` (and
    inlinable: module docstring) by that function's body, in place, calls inside the
    inlined bodies too; the functions stay (unused ones are XLA's to drop). Returns how
    many calls were replaced."""
    replaced = 0
    with module._ctx, ir.Location.unknown(module._ctx):
        functions = _private_functions(module)
        ok = {name: _inlinable(f) for name, f in functions.items()}
        while True:
            calls = [
                op
                for op in module._operations()
                if op.name == "func.call"
                and ok.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value, False)
            ]
            # A recursive function would be inlined forever: stop after a bound
            if not calls or replaced > 100_000:
                return replaced
            for op in calls:
                _inline_one(op, functions[ir.FlatSymbolRefAttr(op.attributes["callee"]).value])
                replaced += 1
