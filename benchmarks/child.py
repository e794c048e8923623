"""Measurements that need a fresh process: load time, bundle reading, peak memory.

Run by benchmarks/run.py as ``python benchmarks/child.py MODE ...``; prints one JSON
object on its last line. Imports stepbundle.runtime and numpy only (no torch), like a
user's training process that runs a bundle.

Modes:
  load BUNDLE BATCH CACHE_DIR [--no-pack]
                                     import, load (compile or cache hit), first step;
                                     --no-pack loads with pack_state=False (one buffer per
                                     state tensor, the program without the packing wrapper)
  read BUNDLE                        open the bundle and digest-check every section, first
                                     with its pages evicted from the page cache, then cached
  rss BUNDLE BATCH CACHE_DIR STEPS --donate|--no-donate
                                     peak resident memory (VmHWM) while loading and while
                                     stepping. (ru_maxrss is no use here: Linux carries it
                                     over from the parent across fork and exec.)
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import time

from stepbundle.runtime import CompileOptions, LoadOptions, SafetyOptions, StateOptions

T_START = time.perf_counter()


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(m.group(1)) if m else -1


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _batch(path: str) -> dict[str, object]:
    import numpy as np

    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _evict(path: str) -> None:
    """Drop the file's pages from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load(bundle: str, batch_path: str, cache_dir: str, pack: bool = True) -> dict[str, object]:
    t0 = time.perf_counter()
    import numpy as np  # noqa: F401

    from stepbundle.runtime import load as sb_load

    t1 = time.perf_counter()
    batch = _batch(batch_path)
    t2 = time.perf_counter()
    trainer = sb_load(
        bundle,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=cache_dir), state=StateOptions(pack_state=pack)
        ),
    )
    t3 = time.perf_counter()
    loss = float(trainer.step(batch)["loss"])
    t4 = time.perf_counter()
    return {
        "pack_state": pack,
        "import_s": t1 - t0,
        "load_s": t3 - t2,
        "first_step_s": t4 - t3,
        "load_to_first_step_s": t4 - t2,
        "load_stages_s": trainer.load_info.seconds,
        "cache_hits": trainer.load_info.cache_hits,
        "compiled": trainer.load_info.compiled,
        "loss": loss,
    }


def _read_once(bundle: str) -> dict[str, object]:
    import stepbundle.schema as codec

    t0 = time.perf_counter()
    with codec.open_bundle(bundle) as b:
        t1 = time.perf_counter()
        total = 0
        for sec in b.manifest.sections:
            view = b.section(sec.name)  # checks the SHA-256 of every byte
            total += len(view)
            view.release()
        t2 = time.perf_counter()
        size = b.file_size
    return {
        "file_bytes": size,
        "section_bytes": total,
        "open_s": t1 - t0,
        "sections_s": t2 - t1,
        "total_s": t2 - t0,
        "mb_per_s": size / 1e6 / (t2 - t0),
    }


def read(bundle: str) -> dict[str, object]:
    """Read the bundle with its pages evicted from the page cache, then again, cached."""
    _evict(bundle)
    evicted = _read_once(bundle)
    cached = _read_once(bundle)
    return {"evicted": evicted, "cached": cached}


def rss(
    bundle: str, batch_path: str, cache_dir: str, steps: int, donate: bool
) -> dict[str, object]:
    from stepbundle.runtime import load as sb_load

    batch = _batch(batch_path)
    base = _status_kb("VmRSS")
    t0 = time.perf_counter()
    # stop_on_nonfinite compiles the step without donation; its per-step loss check is
    # switched off again below, so the two variants differ in donation only.
    trainer = sb_load(
        bundle,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=cache_dir),
            safety=SafetyOptions(stop_on_nonfinite=not donate),
        ),
    )
    trainer._dispatcher.stop_on_nonfinite = False
    load_s = time.perf_counter() - t0
    stages = dict(trainer.load_info.seconds)
    state_bytes = sum(int(a.nbytes) for a in trainer._store.buffers)
    peak_load = _status_kb("VmHWM")
    after_load = _status_kb("VmRSS")
    file_after_load = _status_kb("RssFile")
    # load() leaves the bundle's memory map to the cyclic garbage collector (it shows as
    # file-backed RSS until then); collect it so the stepping peak is the state's own.
    gc.collect()
    after_gc = _status_kb("VmRSS")
    reset = _reset_peak()
    for _ in range(steps):
        float(trainer.step(batch)["loss"])  # one step in flight at a time, both variants
    peak_steps = _status_kb("VmHWM") if reset else -1
    return {
        "donate": donate,
        "steps": steps,
        "state_bytes": state_bytes,
        "load_s": load_s,
        "load_stages_s": stages,
        "rss_before_load_kb": base,
        "rss_after_load_kb": after_load,
        "rss_file_after_load_kb": file_after_load,
        "rss_after_gc_kb": after_gc,
        "peak_rss_load_kb": peak_load,
        "peak_rss_steps_kb": peak_steps,
        "rss_after_steps_kb": _status_kb("VmRSS"),
    }


def main(argv: list[str]) -> int:
    mode, *rest = argv
    if mode == "load":
        out = load(rest[0], rest[1], rest[2], pack="--no-pack" not in rest)
    elif mode == "read":
        out = read(rest[0])
    elif mode == "rss":
        out = rss(rest[0], rest[1], rest[2], int(rest[3]), "--donate" in rest)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    out["process_s"] = time.perf_counter() - T_START
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
