"""Which devices a run uses: the device string, the PJRT client, one device or the first N.

Imports: jax/jaxlib (through _compat).
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from ..errors import PlatformError

__all__ = ["client_for", "parse_device", "select_devices"]

_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def parse_device(device: str) -> tuple[str, int]:
    """``"cuda:1"`` -> ("cuda", 1); ``"cpu"`` -> ("cpu", 0)."""
    name, _, idx = str(device).partition(":")
    name = name.strip().lower()
    if name == "gpu":
        name = "cuda"
    if name not in _PLATFORMS:
        raise PlatformError(
            f"Unknown device {device!r}. Use one of {', '.join(_PLATFORMS)}, optionally with "
            "an index (cuda:1)."
        )
    try:
        index = int(idx) if idx else 0
    except ValueError:
        raise PlatformError(f"Bad device index in {device!r}; use for example cuda:0.") from None
    return name, index


_INSTALL = {"cuda": "pip install 'jax[cuda12]'", "tpu": "pip install 'jax[tpu]'"}


_PLUGIN = {"tpu": "libtpu", "cuda": "jax_cuda12_plugin"}
"""The module each accelerator's jax backend installs (its presence: installed, no device)."""


def _plugin_installed(platform: str) -> bool:
    import importlib.util

    name = _PLUGIN.get(platform)
    try:
        return name is not None and importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def client_for(platform: str) -> Any:
    """The PJRT client of ``platform``, or a ``PlatformError`` that says what to install
    (or, where the backend is installed, that this machine has no such device)."""
    try:
        return _compat.get_client(platform)
    except RuntimeError as e:  # jax: "Unknown backend cuda", "Backend 'tpu' failed to initialize"
        if _plugin_installed(platform):
            raise PlatformError(
                f"jax's {platform} backend is installed, but it found no {platform} device "
                f"here ({e}). Run on a machine that has one, use the CPU (device 'cpu', "
                "--device cpu), or, to plan a TPU slice's programs without one, compile "
                "them with stepbundle.runtime.offline.compile_offline for the devices of "
                "jax.experimental.topologies (docs/parallel.md)."
            ) from None
        raise PlatformError(
            f"No {platform} device is available to jax here ({e}). Install jax with its "
            f"{platform} backend ({_INSTALL.get(platform, 'see jax installation docs')}) on a machine "
            f"that has one, or use the CPU (device 'cpu', --device cpu)."
        ) from None


def select_devices(client: Any, device: str, devices: int | str) -> list[Any]:
    """The devices a run uses: one local device, or the first N devices of the job.

    ``devices`` is already checked (``ParallelOptions``): a whole number of at least 1,
    or "all".
    """
    platform, index = parse_device(device)
    local = list(client.local_devices())
    if devices == 1:
        if index >= len(local):
            raise PlatformError(
                f"Device {platform}:{index} does not exist; this machine has "
                f"{len(local)} {platform} device(s)."
            )
        return [local[index]]
    everywhere = list(client.devices())
    n = len(everywhere) if devices == "all" else int(devices)
    if ":" in str(device):
        raise PlatformError(
            f"Pick either one device ({device!r}) or a number of devices (devices={devices}), "
            f"not both: a data-parallel run uses the first N {platform} devices of the job."
        )
    if n > len(everywhere):
        hint = (
            " On a CPU, ask for N virtual devices before jax starts: "
            "stepbundle.runtime.set_cpu_devices(N), or "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N. The CLI sets them itself "
            "for --devices N unless XLA_FLAGS already sets a count."
            if platform == "cpu"
            else " For devices on several hosts, start every host's process with "
            "jax.distributed (the CLI's --coordinator, --num-processes, --process-id)."
        )
        raise PlatformError(
            f"A data-parallel run over {n} devices needs {n} {platform} devices, but the "
            f"job has {len(everywhere)}.{hint}"
        )
    chosen = everywhere[:n]
    processes = {d.process_index for d in everywhere}
    missing = processes - {d.process_index for d in chosen}
    if missing:
        # Every process would wait for the left-out ones at the first checkpoint.
        raise PlatformError(
            f"The first {n} {platform} devices of the job leave out process(es) "
            f"{', '.join(map(str, sorted(missing)))}; every process of a multi-process job "
            "must take part. Use devices='all' or a number that covers every process's "
            "devices."
        )
    return chosen
