"""Child process of ``test_init_from_shards.py``: the host memory of placing a bundle's
state from a sharded checkpoint, measured on this process alone.

``python init_peak_child.py BUNDLE INDEX SIZE``: BUNDLE's external float32 state entries
are given the shape ``(SIZE,)`` (in memory: the manifest is never written), so that each
tensor of the checkpoint at INDEX is large beside the process's own allocations; then
``benchmarks/init_from_scale.measure_placement`` runs ``place_state`` as a load does,
with a ``put`` that reads every byte and keeps nothing. Prints its JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from init_from_scale import measure_placement  # noqa: E402

from stepbundle.runtime.state.init_source import open_source  # noqa: E402
from stepbundle.schema import open_bundle  # noqa: E402
from stepbundle.schema.manifest import DType, SectionKind  # noqa: E402


def main(bundle: str, index: str, size: int) -> None:
    with open_bundle(bundle) as b, open_source(index) as source:
        m = b.manifest
        kinds = {s.name: s.kind for s in m.sections}
        state = tuple(
            dataclasses.replace(e, spec=dataclasses.replace(e.spec, shape=(size,)))
            if kinds[e.section] is SectionKind.EXTERNAL and e.spec.dtype is DType.F32
            else e
            for e in m.state
        )
        grown = dataclasses.replace(m, state=state)
        print(json.dumps(measure_placement(grown, source, b.section)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
