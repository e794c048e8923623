"""``load_into``, named here as the README has always named it.

The function is the front-end core's (``stepbundle.frontend.checkpoint``), which needs no
torch_xla; importing it from here loads the torch_xla front-end as well. Remove this
module once the README and the examples have named ``stepbundle.frontend.checkpoint``
for one release (0.2).
"""

from __future__ import annotations

from stepbundle.frontend.checkpoint import load_into

__all__ = ["load_into"]
