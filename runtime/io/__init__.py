"""Bytes in and out: URLs (``remote``), the bundle store kept by digest (``store``),
mapped safetensors files (``tensor_file``), what kind of file a path is (``file_kinds``)
and how much host memory is left (``host_memory``).

May import: the runtime's base modules (``errors``, ``dtypes``, ``fallback``, ``_compat``)
and stepbundle.schema. Nothing else of the runtime.
"""

from __future__ import annotations

from .file_kinds import NotARegularFileError
from .remote import RemoteError, is_url
from .store import BundleNotFoundError, StoreError, default_cache_dir, pull, resolve_bundle
from .tensor_file import SafetensorsFile, open_safetensors

__all__ = [
    "BundleNotFoundError",
    "NotARegularFileError",
    "RemoteError",
    "SafetensorsFile",
    "StoreError",
    "default_cache_dir",
    "is_url",
    "open_safetensors",
    "pull",
    "resolve_bundle",
]
