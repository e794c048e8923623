"""Size limits a reader enforces before it trusts or allocates anything.

Every limit is checked against numbers read from the file (the header's manifest length,
the manifest's section count, ranks and dimensions) before anything of that size is
allocated, so a crafted bundle cannot make a reader allocate more than the file holds.
The limits are part of the format: changing one changes ``schema.json`` and needs a major
version bump (see ``describe.py``).

Imports: nothing.
"""

from __future__ import annotations

__all__ = ["MAX_DIM", "MAX_MANIFEST_BYTES", "MAX_RANK", "MAX_SECTIONS"]

MAX_MANIFEST_BYTES: int = 64 * 1024 * 1024
"""Largest manifest a reader accepts, checked from the header before anything is read."""

MAX_SECTIONS: int = 1_000_000
"""Most sections one bundle may have."""

MAX_RANK: int = 64
"""Most dimensions a tensor may have."""

MAX_DIM: int = 2**63 - 1
"""Largest dimension, and largest byte size of any tensor: both fit an int64."""
