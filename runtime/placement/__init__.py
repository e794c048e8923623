"""Where arrays live: the device string and client (``devices``), multi-process jobs
(``distributed``), which state tensor each parallel layout splits over which mesh axis
(``shard_plan``), the shardings of every array a step passes (``sharding``) and small
state tensors packed into one buffer per dtype (``packing``).

May import: the base modules and ``io``.
"""

from __future__ import annotations

from .devices import client_for, parse_device, select_devices
from .distributed import set_cpu_devices
from .packing import Layout, plan_layout
from .sharding import Placement

__all__ = [
    "Layout",
    "Placement",
    "client_for",
    "parse_device",
    "plan_layout",
    "select_devices",
    "set_cpu_devices",
]
