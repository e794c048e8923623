"""Does ``rng_bit_generator`` draw the same bits on the CPU and on this device?

    python benchmarks/device/rng_check.py [--out rng.json]

torch_xla writes its dropout masks as ``stablehlo.rng_bit_generator`` with
``algorithm = DEFAULT``, which leaves the algorithm to each backend. This draws 64x32
uint32 from one u64[2] state with DEFAULT, PHILOX and THREE_FRY on the CPU and on every
other backend jax sees, and records which algorithms agree bit for bit across backends
and which one the CPU's DEFAULT is. Imports: jax, numpy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np
from jax import lax

ALGORITHMS = {
    "DEFAULT": lax.RandomAlgorithm.RNG_DEFAULT,
    "PHILOX": lax.RandomAlgorithm.RNG_PHILOX,
    "THREE_FRY": lax.RandomAlgorithm.RNG_THREE_FRY,
}


def draw(platform: str, algorithm: str) -> np.ndarray:
    device = jax.devices(platform)[0]
    # torch_xla's state: u64[2] (the seed and a counter), which needs 64-bit types on.
    with jax.enable_x64(True):
        key = jax.device_put(np.array([2024, 1012031], dtype=np.uint64), device)
        f = jax.jit(lambda k: lax.rng_bit_generator(k, (64, 32), np.uint32, ALGORITHMS[algorithm]))
        state, bits = f(key)
        return np.asarray(bits)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    platforms = sorted({d.platform for d in jax.devices()} | {"cpu"})
    bits = {(pl, al): draw(pl, al) for pl in platforms for al in ALGORITHMS}
    report: dict[str, object] = {"jax": jax.__version__, "platforms": platforms, "same": {}}
    same: dict[str, bool] = {}
    for pl in platforms:
        for al in ALGORITHMS:
            for al2 in ALGORITHMS:
                same[f"{pl}:{al} == cpu:{al2}"] = bool(
                    np.array_equal(bits[pl, al], bits["cpu", al2])
                )
    report["same"] = same
    for k, v in same.items():
        print(f"{k:34s} {v}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
