"""runtime/compile/allocator.py: glibc told to keep freed memory, in fresh processes (the setting
is process-wide). What it changes is read from the kernel: the process's resident memory
after freeing 160 MB, with the default allocator and after ``keep_freed_memory``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from runtime_helpers import golden_bundle

from stepbundle.runtime import CompileOptions, UsageError, load
from stepbundle.runtime.compile import allocator

# Allocates 20 blocks of 8 MB through libc's malloc, touches every page, frees them all,
# and reports the resident memory before and after the frees (from /proc/self/statm).
CHILD = """
import ctypes, json, os, sys
from stepbundle.runtime.compile import allocator
if sys.argv[1] == "late":  # jax's backends (the CPU's here) started first
    import jax
    jax.devices("cpu")
kept = allocator.keep_freed_memory() if sys.argv[1] != "default" else None
again = allocator.keep_freed_memory() if sys.argv[1] != "default" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
blocks = [libc.malloc(8 << 20) for _ in range(20)]
for b in blocks:
    ctypes.memset(b, 1, 8 << 20)
full = resident()
for b in blocks:
    libc.free(b)
print(json.dumps({"kept": kept, "again": again, "full": full, "after": resident()}))
"""


def _child(mode: str, **env: str) -> dict[str, object]:
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"
    }
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
        timeout=120,
    ).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
def test_freed_memory_goes_back_by_default_and_stays_when_kept() -> None:
    mb = 1 << 20
    default = _child("default")
    kept = _child("keep")
    assert kept["kept"] is True and kept["again"] is True  # glibc took all three settings
    # Default glibc: 8 MB blocks are mapped apart and unmapped when freed.
    assert int(default["full"]) - int(default["after"]) > 150 * mb  # type: ignore[call-overload]
    # Kept: they came from the heap, which is not trimmed.
    assert int(kept["full"]) - int(kept["after"]) < 10 * mb  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "mode, env",
    [
        ("keep", {"MALLOC_TRIM_THRESHOLD_": "131072"}),
        ("keep", {"MALLOC_ARENA_MAX": "4"}),
        ("keep", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}),
        ("late", {}),
    ],
    ids=["malloc-variable", "malloc-arena-max", "glibc-tunables", "backends-already-started"],
)
def test_glibc_is_left_alone(mode: str, env: dict[str, str]) -> None:
    result = _child(mode, **env)
    assert result["kept"] is False and result["again"] is False  # decided once
    mb = 1 << 20
    # Nothing was set: the 8 MB blocks were mapped apart and went back when freed.
    assert int(result["full"]) - int(result["after"]) > 150 * mb  # type: ignore[call-overload]


DECIDE = """
import json, sys
from stepbundle.runtime.compile import allocator
setting = {"True": True, "False": False}.get(sys.argv[1], sys.argv[1])
kept, why = allocator.decide(setting)
print(json.dumps({"kept": kept, "why": why, "cost": allocator.syscall_us()}))
"""


def _decide(setting: str, **env: str) -> dict[str, object]:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", allocator.ENV)
    }
    environ.update(env)
    out = subprocess.run(
        [sys.executable, "-c", DECIDE, setting],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_auto_follows_the_measured_system_call_cost() -> None:
    result = _decide("auto")
    cost = float(result["cost"])  # type: ignore[arg-type]
    assert 0 < cost < 1000
    assert "system call costs" in str(result["why"])
    # The rule, unless this host sits right at the threshold (then either answer is fair).
    if abs(cost - allocator.SLOW_SYSCALL_US) > 0.5:
        assert result["kept"] is (cost >= allocator.SLOW_SYSCALL_US), result


@pytest.mark.parametrize(
    "setting, env, kept, said",
    [
        ("True", {}, True, "keep_freed_memory=True"),
        ("False", {}, False, "left alone (keep_freed_memory=False)"),
        ("auto", {"STEPBUNDLE_KEEP_FREED_MEMORY": "1"}, True, "STEPBUNDLE_KEEP_FREED_MEMORY=1"),
        ("auto", {"STEPBUNDLE_KEEP_FREED_MEMORY": "0"}, False, "STEPBUNDLE_KEEP_FREED_MEMORY=0"),
        # the option, when set, wins over the environment
        ("False", {"STEPBUNDLE_KEEP_FREED_MEMORY": "1"}, False, "keep_freed_memory=False"),
        # a user's allocator settings win over a True
        ("True", {"MALLOC_ARENA_MAX": "4"}, False, "left alone although asked"),
    ],
)
def test_the_setting_and_its_reason(
    setting: str, env: dict[str, str], kept: bool, said: str
) -> None:
    result = _decide(setting, **env)
    assert result["kept"] is kept and said in str(result["why"]), result


def test_a_bad_setting_is_refused() -> None:
    for bad in ("yes", 1, None):
        with pytest.raises(UsageError, match="keep_freed_memory must be"):
            CompileOptions(keep_freed_memory=bad)  # type: ignore[arg-type]
    environ = {**os.environ, allocator.ENV: "sometimes"}
    out = subprocess.run(
        [sys.executable, "-c", DECIDE, "auto"], capture_output=True, text=True, env=environ
    )
    assert out.returncode != 0 and "must be 1, 0 or auto" in out.stderr


def test_it_is_decided_for_tpus_only() -> None:
    assert CompileOptions().keep_freed_memory == "auto"
    # A CPU load leaves the allocator alone (what it changes was measured on a TPU host).
    trainer = load(golden_bundle("linear_adamw"))
    assert trainer.load_info.kept_freed_memory is False and trainer.load_info.allocator == ""
