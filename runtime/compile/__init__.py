"""From a program section to an executable: the checks (``validate``), the rewrites
(``rewrites``, with ``fused_attention`` and ``multistep``), the persistent compile cache
(``compile_cache``), one program compiled (``program``), the allocator setting for TPU
compiles (``allocator``) and the record of how loading went (``load_info``).

May import: the base modules, ``io``, ``placement`` and stepbundle.stablehlo.
"""

from __future__ import annotations

from .compile_cache import CacheEvent, CacheOutcome, CacheWarning, CompileCache
from .load_info import LoadInfo
from .program import CompiledProgram, compile_program
from .rewrites import REWRITES, RewriteContext, apply_rewrites

__all__ = [
    "REWRITES",
    "CacheEvent",
    "CacheOutcome",
    "CacheWarning",
    "CompileCache",
    "CompiledProgram",
    "LoadInfo",
    "RewriteContext",
    "apply_rewrites",
    "compile_program",
]
