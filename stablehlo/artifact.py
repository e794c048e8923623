"""StableHLO handling through jaxlib's MLIR bindings: read, check, re-attribute, write.

Programs are stored as StableHLO portable artifacts. At load the runtime parses the
artifact, checks ``@main``'s signature against the binding table, refuses custom calls
that are not on the allowlist, and regenerates the aliasing attributes from the
manifest's alias table (it never trusts the module's own). The exporter uses the same
functions to write artifacts, so both sides agree on one implementation.

Imports: jaxlib's MLIR bindings, stepbundle.schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as _stablehlo

from stepbundle.schema.errors import BundleError

# jaxlib's stubs do not cover the StableHLO dialect's serialization helpers.
stablehlo: Any = _stablehlo

__all__ = [
    "ALLOWED_CUSTOM_CALLS",
    "ArtifactError",
    "ProgramError",
    "MainSignature",
    "Module",
    "TARGET_CANDIDATES",
    "parse_artifact",
]

# Custom calls the exporter can produce from torch_xla graphs, and that every PJRT
# backend implements. Anything else in a program is refused at load: a bundle is code,
# and a custom call target is a native function pointer lookup.
ALLOWED_CUSTOM_CALLS: frozenset[str] = frozenset(
    {
        # Sharding annotations of SPMD programs.
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        # Math ops StableHLO has no op for; torch_xla emits them as custom calls that
        # XLA turns back into its own ops on every backend (GELU uses erf).
        "mhlo.erf",
        "mhlo.erf_inv",
        "mhlo.topk",
        "mhlo.acos",
        "mhlo.acosh",
        "mhlo.asin",
        "mhlo.asinh",
        "mhlo.atan",
        "mhlo.atanh",
        "mhlo.cosh",
        "mhlo.sinh",
        "mhlo.tan",
        "mhlo.lgamma",
        "mhlo.digamma",
        "mhlo.polygamma",
        "mhlo.bessel_i1e",
        "mhlo.zeta",
        "mhlo.next_after",
    }
)

# Operations that exchange data with the host or other programs outside the step's
# arguments and results. The exporter never emits them; the runtime refuses them.
HOST_TRANSFER_OPS: frozenset[str] = frozenset(
    f"{dialect}.{op}"
    for dialect in ("stablehlo", "mhlo")
    for op in ("infeed", "outfeed", "send", "recv")
)

_ELEMENT_NAMES = {
    "f64": "f64",
    "f32": "f32",
    "bf16": "bf16",
    "f16": "f16",
    "i64": "i64",
    "i32": "i32",
    "i16": "i16",
    "i8": "i8",
    "ui64": "u64",
    "ui32": "u32",
    "ui16": "u16",
    "ui8": "u8",
    "i1": "bool",
}


def _compat_versions() -> list[str]:
    req = stablehlo.StablehloCompatibilityRequirement
    out: list[str] = []
    for name in ("MAX", "WEEK_12", "WEEK_4", "NONE"):
        level = getattr(req, name, None)
        if level is not None:
            v = str(stablehlo.get_version_from_compatibility_requirement(level))
            if v not in out:
                out.append(v)
    return out


TARGET_CANDIDATES: tuple[str, ...] = tuple(_compat_versions())
"""Serialization targets, widest compatibility window first."""


def make_context() -> ir.Context:
    """A fresh MLIR context with the dialects torch_xla's programs use."""
    from jaxlib.mlir._mlir_libs import _mlirHlo
    from jaxlib.mlir.dialects import chlo as _chlo
    from jaxlib.mlir.dialects import sdy as _sdy

    chlo: Any = _chlo
    sdy: Any = _sdy
    ctx = ir.Context()
    stablehlo.register_dialect(ctx)
    _mlirHlo.register_mhlo_dialect(ctx)
    chlo.register_dialect(ctx)
    sdy.register_dialect(ctx)  # Shardy: the sharding annotations of data-parallel runs
    ctx.load_all_available_dialects()
    return ctx


@dataclass(frozen=True)
class MainSignature:
    """``@main``'s argument and result types as (dtype name, shape) pairs."""

    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    results: tuple[tuple[str, tuple[int, ...]], ...]


def _type_spec(t: Any) -> tuple[str, tuple[int, ...]]:
    rt = ir.RankedTensorType(t)
    shape = tuple(int(d) for d in rt.shape)
    elem = str(rt.element_type)
    return _ELEMENT_NAMES.get(elem, elem), shape


class Module:
    """A parsed StableHLO module with the operations the runtime and exporter need."""

    def __init__(self, ctx: ir.Context, module: ir.Module) -> None:
        self._ctx = ctx
        self._module = module

    def _find_main(self) -> Any | None:
        for op in self._module.body.operations:
            if (
                op.operation.name == "func.func"
                and ir.StringAttr(op.attributes["sym_name"]).value == "main"
            ):
                return op
        return None

    @property
    def main(self) -> Any:
        op = self._find_main()
        if op is None:
            raise ProgramError("the module has no @main function")
        return op

    def replace_main(self, inner: str, wrapper: str) -> None:
        """Put a new ``@main`` in front of this module's: the old one becomes the private
        function ``@inner``, and ``wrapper`` (MLIR text of a module that declares
        ``@inner`` and defines the new ``@main``) supplies the new one.

        Built with the MLIR API: the symbol is renamed by its attribute and the new
        function is parsed on its own and moved in, so nothing in this module's text
        (an attribute that happens to read ``func.func @main(``, say) can be mistaken
        for its structure.

        Raises:
          ValueError: the module has a symbol named ``inner`` already, ``wrapper`` has no
            single ``@main``, or the result does not verify.
        """
        with self._ctx:
            taken = {
                ir.StringAttr(op.attributes["sym_name"]).value
                for op in self._module.body.operations
                if "sym_name" in op.attributes
            }
            if inner in taken:
                raise ProgramError(f"the module already has a symbol @{inner}")
            main = self.main
            parsed = ir.Module.parse(wrapper)
            new = [
                op
                for op in parsed.body.operations
                if "sym_name" in op.attributes
                and ir.StringAttr(op.attributes["sym_name"]).value == "main"
            ]
            if len(new) != 1:
                raise ProgramError("the wrapper must define exactly one @main")
            main.attributes["sym_name"] = ir.StringAttr.get(inner)
            main.attributes["sym_visibility"] = ir.StringAttr.get("private")
            new[0].detach_from_parent()
            self._module.body.append(new[0])
            if not self._module.operation.verify():
                raise ProgramError("the wrapped module does not verify")

    @staticmethod
    def parse_text(like: Module, text: str) -> Module:
        """Parse MLIR text in ``like``'s context (which has its dialects loaded)."""
        with like._ctx:
            return Module(like._ctx, ir.Module.parse(text))

    def main_types(self) -> tuple[list[str], list[str]]:
        """``@main``'s input and result types as MLIR text (``tensor<2x3xf32>``)."""
        with self._ctx:
            ft = ir.FunctionType(ir.TypeAttr(self.main.attributes["function_type"]).value)
            return [str(t) for t in ft.inputs], [str(t) for t in ft.results]

    def signature(self) -> MainSignature:
        with self._ctx:
            ft = ir.FunctionType(ir.TypeAttr(self.main.attributes["function_type"]).value)
            return MainSignature(
                tuple(_type_spec(t) for t in ft.inputs), tuple(_type_spec(t) for t in ft.results)
            )

    def _operations(self) -> list[Any]:
        """Every operation in the module, nested regions and private functions included."""
        ops: list[Any] = []
        with self._ctx:
            stack: list[Any] = [self._module.operation]
            while stack:
                op = stack.pop()
                ops.append(op)
                for region in op.regions:
                    for block in region.blocks:
                        stack.extend(child.operation for child in block.operations)
        return ops

    def custom_call_targets(self) -> set[str]:
        """Every custom_call target name in the module (all functions, nested regions).

        Read from the operations' ``call_target_name`` attributes, not from the printed
        text: a target printed quoted (``@"any name"``) or with escapes would slip past a
        pattern over the text.
        """
        targets: set[str] = set()
        with self._ctx:
            for op in self._operations():
                if "call_target_name" in op.attributes:
                    attr = op.attributes["call_target_name"]
                    try:
                        targets.add(ir.StringAttr(attr).value)
                    except (ValueError, TypeError):
                        targets.add(str(attr))  # not a string: reported as it prints
                elif op.name.endswith(".custom_call"):
                    targets.add(f"<{op.name} without a target>")
        return targets

    def host_transfer_ops(self) -> set[str]:
        """Operations that move data between the program and the host or other programs."""
        with self._ctx:
            return {op.name for op in self._operations() if op.name in HOST_TRANSFER_OPS}

    def strip_attributes(self) -> None:
        """Drop module- and argument-level attributes outside StableHLO's guarantee.

        torch_xla writes ``mhlo.*`` module attributes (an empty alias list among them);
        aliasing is carried by the manifest and regenerated at load. The module's name
        (torch_xla's ``IrToHlo.<counter>``, which counts the graphs lowered so far in the
        process) becomes ``main_module``, so the same step exports to the same bytes.
        """
        with self._ctx:
            op = self._module.operation
            if "sym_name" in op.attributes:
                op.attributes["sym_name"] = ir.StringAttr.get("main_module")
            # Iterating attributes yields NamedAttribute in jaxlib 0.7 and plain names
            # in newer releases.
            attributes: Any = op.attributes
            for name in [a if isinstance(a, str) else a.name for a in attributes]:
                if name.startswith("mhlo.") and name not in (
                    "mhlo.num_partitions",
                    "mhlo.num_replicas",
                ):
                    del op.attributes[name]
            main = self.main
            if "arg_attrs" in main.attributes:
                del main.attributes["arg_attrs"]
            if "res_attrs" in main.attributes:
                del main.attributes["res_attrs"]

    def set_arg_attributes(
        self, aliases: Sequence[int | None], shardings: Sequence[str] | None = None
    ) -> None:
        """Set ``tf.aliasing_output`` on every argument from ``aliases``.

        ``aliases[i]`` is the result index argument ``i`` is donated to, or None.
        ``shardings[i]``, when given, is argument ``i``'s Shardy sharding as MLIR text
        (``#sdy.sharding<@mesh, [{"data"}, {}]>``); see ``set_mesh``. Any attributes
        the arguments had before are replaced.
        """
        with self._ctx:
            i32 = ir.IntegerType.get_signless(32)
            attrs = []
            for i, out in enumerate(aliases):
                d: dict[str, Any] = {}
                if out is not None:
                    d["tf.aliasing_output"] = ir.IntegerAttr.get(i32, out)
                if shardings is not None:
                    d["sdy.sharding"] = ir.Attribute.parse(shardings[i])
                attrs.append(ir.DictAttr.get(d))
            self.main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)

    def set_result_shardings(self, shardings: Sequence[str]) -> None:
        """Pin every result of ``@main`` to a Shardy sharding (MLIR text, one per result)."""
        with self._ctx:
            self.main.attributes["res_attrs"] = ir.ArrayAttr.get(
                [ir.DictAttr.get({"sdy.sharding": ir.Attribute.parse(s)}) for s in shardings]
            )

    def set_mesh(self, name: str, axes: Sequence[tuple[str, int]]) -> None:
        """Declare a Shardy device mesh ``@name`` and the module's partition count.

        The SPMD partitioner reads the shardings of ``@main``'s arguments and results
        against this mesh and inserts the collectives the program then needs.
        """
        from jaxlib.mlir.dialects import sdy as _sdy

        sdy: Any = _sdy
        partitions = 1
        for _, size in axes:
            partitions *= size
        with self._ctx, ir.Location.unknown():
            body = self._module.body
            with ir.InsertionPoint.at_block_begin(body):
                sdy.MeshOp(
                    name, sdy.MeshAttr.get([sdy.MeshAxisAttr.get(a, n) for a, n in axes], [])
                )
            i32 = ir.IntegerType.get_signless(32)
            self._module.operation.attributes["mhlo.num_partitions"] = ir.IntegerAttr.get(
                i32, partitions
            )
            self._module.operation.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, 1)

    def bytecode(self) -> bytes:
        """The module as MLIR bytecode in this jaxlib's own version (to compile)."""
        with self._ctx:
            data = self._module.operation.get_asm(binary=True)
        assert isinstance(data, bytes)
        return data

    def text(self) -> str:
        with self._ctx:
            return str(self._module)

    def portable_artifact(self, target: str) -> bytes:
        """Serialize as a StableHLO portable artifact readable from ``target`` on."""
        with self._ctx:
            data = stablehlo.serialize_portable_artifact(self._module, target)
        assert isinstance(data, bytes)
        return data


class ProgramError(BundleError, ValueError):
    """A program cannot be built, wrapped or rewritten as asked (an operand of dynamic
    shape, a module that does not verify afterwards). Also a ``ValueError``: a rewrite
    that cannot handle a program is caught as one, and the program kept as it was."""


class ArtifactError(ProgramError):
    """The bytes are not a StableHLO portable artifact this jaxlib can read.

    The message says what was found instead (plain MLIR bytecode, MLIR text, something
    else, or an artifact this jaxlib could not read) as a clause; callers wrap it in
    their own error with the fix.
    """


_BYTECODE_MAGIC = b"ML\xefR"
_PORTABLE_PRODUCER = "StableHLO_v"


def _bytecode_producer(raw: bytes) -> str | None:
    """The producer string of MLIR bytecode (``StableHLO_v1.2.3`` for a portable
    artifact), or None when ``raw`` is not MLIR bytecode.

    The header is the magic, the bytecode version as MLIR's prefix varint (the count of
    trailing zero bits of its first byte is the number of bytes that follow; 0 means 8),
    then the producer, NUL-terminated.
    """
    if not raw.startswith(_BYTECODE_MAGIC) or len(raw) <= len(_BYTECODE_MAGIC):
        return None
    first = raw[len(_BYTECODE_MAGIC)]
    extra = 8 if first == 0 else (first & -first).bit_length() - 1
    start = len(_BYTECODE_MAGIC) + 1 + extra
    end = raw.find(b"\0", start, start + 256)
    if end < 0:
        return None
    return raw[start:end].decode("utf-8", errors="replace")


def _describe(raw: bytes) -> str:
    """What ``raw`` is, when it is not a portable artifact: a clause for a message."""
    if not raw:
        return "it is empty"
    producer = _bytecode_producer(raw)
    if producer is not None:
        return f"it is plain MLIR bytecode (producer {producer!r}), not a portable artifact"
    head = raw[:4096].lstrip()
    if head.startswith((b"module", b"func.func", b"#", b"//")) or b"func.func @main" in head:
        return "it is MLIR text, not a portable artifact"
    return f"it is not MLIR at all (it starts with {raw[:8].hex()})"


def parse_artifact(data: bytes | memoryview) -> Module:
    """Parse a StableHLO portable artifact into a Module.

    Only portable artifacts are accepted (``schema/FORMAT.md``: a program section is one):
    plain MLIR bytecode or text is tied to the MLIR version that wrote it and is refused
    rather than parsed on a best-effort basis.

    Raises:
      ArtifactError: the bytes are not a portable artifact, this jaxlib could not read
        it (damaged, or written for a newer StableHLO), or it has no ``@main``.
    """
    raw = bytes(data)
    producer = _bytecode_producer(raw)
    if producer is None or not producer.startswith(_PORTABLE_PRODUCER):
        raise ArtifactError(f"the section is not a StableHLO portable artifact: {_describe(raw)}")
    ctx = make_context()
    with ctx:
        try:
            module = stablehlo.deserialize_portable_artifact(ctx, raw)
        # jaxlib reports every failure to read an artifact as ValueError ("failed to
        # deserialize module"); its diagnostics went to stderr.
        except ValueError as e:
            newest = stablehlo.get_current_version()
            raise ArtifactError(
                f"the portable artifact ({producer}) could not be read by this jaxlib, "
                f"which reads StableHLO up to {newest} ({e}): it is damaged, or was written "
                "for a newer StableHLO"
            ) from None
    parsed = Module(ctx, module)
    with ctx:
        if parsed._find_main() is None:
            raise ArtifactError("the portable artifact has no @main function")
    return parsed
