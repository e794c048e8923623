"""Attention that ``attention.py`` found, swapped for fused kernels.

``rewrite_attention`` puts a call of a fused forward function where the attention's
output product ``o`` was, and of a fused backward function (taking the forward's
residuals) where the first of ``dq``, ``dkt``, ``dv`` was; the functions come from the
caller (``runtime/compile/fused_attention.py`` lowers jax's Pallas kernels) as MLIR text, are
checked against the site's types and moved into the module as private functions (one
pair per shape). The (T, T) operations are left for XLA to drop, unused.

Imports: jaxlib's MLIR bindings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .artifact import Module, ProgramError
from .attention import Site, StateValues, find_attention
from .build import verify
from .graph import call, function_type, insert_functions

__all__ = ["Kernels", "rewrite_attention"]

Kernels = Callable[[Site], tuple[str, str | None]]
"""Site -> (forward module text, backward module text or None): each a module whose
``@main`` takes (q, kt, v, scale) and returns (o, *residuals), and takes (*residuals, do)
and returns (dq, dkt, dv)."""


def _types(values: Any) -> list[str]:
    return [str(v.type) for v in values]


def _check_signatures(module: Module, site: Site, fwd: str, bwd: str | None) -> None:
    """The functions take and give what the site's values are (a lowering that dropped an
    unused argument, say, would not)."""
    f = function_type(module, fwd)
    want = _types([site.q, site.kt, site.v, site.scale])
    got_in, got_out = [str(t) for t in f.inputs], [str(t) for t in f.results]
    if got_in != want or not got_out or got_out[0] != str(site.out.result.type):
        raise ProgramError(f"the fused forward takes {got_in} -> {got_out}, the site {want}")
    if bwd is None or site.do is None:
        return
    b = function_type(module, bwd)
    want = got_out[1:] + [str(site.do.type)]
    grads = _types([site.dq.result, site.dkt.result, site.dv.result])
    if [str(t) for t in b.inputs] != want or [str(t) for t in b.results] != grads:
        raise ProgramError(
            f"the fused backward takes {[str(t) for t in b.inputs]} -> "
            f"{[str(t) for t in b.results]}, the site {want} -> {grads}"
        )


def rewrite_attention(
    module: Module,
    kernels: Kernels,
    scalars: dict[int, float] | None = None,
    accept: Callable[[Site], bool] = lambda site: True,
    misses: list[str] | None = None,
    state: StateValues | None = None,
    state_reads: set[int] | None = None,
    names: Mapping[int, str] | None = None,
) -> int:
    """Replace every attention ``find_attention`` finds by calls of the fused functions
    ``kernels`` gives, in place (those ``accept`` takes). Returns the number replaced.
    ``misses`` gets ``find_attention``'s reasons for the attentions it did not take.
    ``state``: the state arguments a mask may be read from, as loaded; ``state_reads``
    gets those the replaced sites' masks were computed from (the program now assumes
    them: the caller must hold the state to them). ``names``: what @main's other
    arguments are, for the reasons (``find_attention``).

    Raises:
      ValueError: the module does not verify afterwards (it may be partly rewritten:
        the runtime rewrites a copy).
    """
    sites = [s for s in find_attention(module, scalars, misses, state, names) if accept(s)]
    if not sites:
        return 0
    if state_reads is not None:
        state_reads.update(n for s in sites for n in s.state_reads)
    with module._ctx:
        made: dict[Any, tuple[str, str | None]] = {}
        for site in sites:
            if site.key not in made:
                fwd_text, bwd_text = kernels(site)
                n = len(made)
                fwd = insert_functions(module, fwd_text, f"stepbundle_attention{n}_fwd")
                bwd = (
                    insert_functions(module, bwd_text, f"stepbundle_attention{n}_bwd")
                    if bwd_text is not None
                    else None
                )
                made[site.key] = (fwd, bwd)
                _check_signatures(module, site, fwd, bwd)
            fwd, bwd = made[site.key]
            out = call(module, fwd, [site.q, site.kt, site.v, site.scale], site.out)
            site.out.result.replace_all_uses_with(out[0])
            if site.do is None:
                continue
            if bwd is None:
                raise ProgramError("a training attention needs a backward function")
            grads = [site.dq, site.dkt, site.dv]
            first = site.first_grad
            dq, dkt, dv = call(module, bwd, [*out[1:], site.do], first)
            for op, new in zip(grads, (dq, dkt, dv)):
                op.result.replace_all_uses_with(new)
        verify(module._module, "fusing attention")
    return len(sites)
