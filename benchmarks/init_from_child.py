"""One measured load in a fresh process, for benchmarks/init_from.py.

``python benchmarks/init_from_child.py BUNDLE CACHE_DIR BATCH [INIT_FROM]`` loads BUNDLE
(with INIT_FROM as ``init_from`` when given), takes one step, and prints one JSON object
on its last line: resident memory (VmRSS, VmHWM, RssAnon, RssFile from /proc/self/status)
before loading, around the placement of the state (``init_state.place_state``, timed by a
wrapper that calls the real function) and after, the bytes the state holds on the
device, and the first loss. Imports stepbundle.runtime and numpy only (no torch).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child import _reset_peak, _status_kb  # noqa: E402

from stepbundle.runtime import CompileOptions, LoadOptions, StateOptions


def _memory() -> dict[str, int]:
    return {k: _status_kb(k) for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def main(argv: list[str]) -> int:
    bundle, cache, batch_path, *rest = argv
    init_from = rest[0] if rest else None
    import numpy as np

    from stepbundle.runtime import load

    # The module, not the function ``stepbundle.runtime.load`` its package exports.
    load_module = sys.modules["stepbundle.runtime.load"]

    with np.load(batch_path) as z:
        batch = {k: z[k] for k in z.files}
    placement: dict[str, Any] = {}
    real = load_module.place_state

    def measured(*args: Any, **kwargs: Any) -> Any:
        gc.collect()  # garbage freed during placement would otherwise lower its peak
        placement["before"] = _memory()
        placement["peak_reset"] = _reset_peak()
        t0 = time.perf_counter()
        out = real(*args, **kwargs)
        placement["seconds"] = time.perf_counter() - t0
        placement["after"] = _memory()
        return out

    load_module.place_state = measured
    before = _memory()
    reset = _reset_peak()
    t0 = time.perf_counter()
    trainer = load(
        bundle,
        options=LoadOptions(
            compile=CompileOptions(cache_dir=cache), state=StateOptions(init_from=init_from)
        ),
    )
    load_s = time.perf_counter() - t0
    after = _memory()
    state_bytes = sum(int(a.nbytes) for a in trainer._store.buffers)
    loss = np.asarray(trainer.step(batch)["loss"])
    print(
        json.dumps(
            {
                "init_from": init_from,
                "before_load": before,
                "peak_reset": reset,
                "after_load": after,
                "placement": placement,
                "state_bytes": state_bytes,
                "load_s": load_s,
                "compiled": trainer.load_info.compiled,
                "origins": sorted(set(trainer.load_info.state_origins.values())),
                "loss_hex": loss.tobytes().hex(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
