#!/usr/bin/env bash
# Device check on an NVIDIA machine (issue #17), in under 10 minutes, never part of CI:
#
#   1. the golden bundles of every format version run on CUDA, against their expected
#      numbers (relative errors recorded; GPU matmuls may use TF32, so they are reported,
#      not asserted at the CPU's 1e-5);
#   2. K steps per call are bit for bit K single steps on CUDA too (the loop wrapper);
#   3. the runtime tests that do not need torch (tests/runtime, lean environment), with
#      the time left. They load with the default device="cpu", so they check the lean
#      runtime on that machine's jax, not on CUDA: steps 1, 2 and 4 are the CUDA part
#      (a switch that points the test suite at CUDA is not there yet);
#   4. step times of the golden bundles on CUDA for steps_per_call 1, 8 and 32.
#
# Writes benchmarks/results/device/<UTC time>/{device_check.json,pytest.txt}. Needs jax's
# CUDA plugin in the lean environment (pip install 'jax[cuda12]'); no torch.
#
#   bash scripts/device_check.sh            # PYTHON=... to use another interpreter
#   bash -n scripts/device_check.sh         # what CI may do: parse it, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv-lean/bin/python}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=benchmarks/results/device/$STAMP
mkdir -p "$OUT"
deadline=$((SECONDS + 570))

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "device_check: no nvidia-smi here; this script is for an NVIDIA machine." >&2
  exit 3
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/gpu.txt" || true
if ! "$PY" -c "import jax, sys; sys.exit(0 if jax.devices('cuda') else 1)" 2>"$OUT/jax_cuda.err"; then
  echo "device_check: jax sees no CUDA device ($(tail -1 "$OUT/jax_cuda.err")); install" \
    "jax's CUDA plugin into the lean environment: $PY -m pip install 'jax[cuda12]'." >&2
  exit 3
fi

# 1, 2 and 4: one Python process (compiles are the slow part; the cache is private).
STEPBUNDLE_CACHE_DIR="$OUT/xla-cache" timeout 300 "$PY" - "$OUT/device_check.json" <<'PY'
import json, platform, sys, time
sys.path.insert(0, "tests/runtime")
import jax
import numpy as np
from runtime_helpers import (GOLDEN_SCHEDULES, GOLDEN_STEPS, golden_batches, golden_bundle,
                             golden_expected, golden_names, golden_versions, rel)
from stepbundle.runtime import load

out = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices("cuda")],
       "python": platform.python_version(), "golden": [], "steps_per_call": [], "step_ms": []}

def trainer(name, version=None, **kw):
    t = load(golden_bundle(name, version), device="cuda", **kw)
    if name in GOLDEN_SCHEDULES:
        t.set_schedule("lr", GOLDEN_SCHEDULES[name])
    return t

for version in golden_versions():
    for name in golden_names(version):
        t0 = time.perf_counter()
        t = trainer(name, version)
        exp = golden_expected(name, version)
        ms = t.run(golden_batches(name, version), GOLDEN_STEPS[name])
        errs = {f"metric/{k}": rel(np.array([float(m[k]) for m in ms]), exp[f"metric/{k}"])
                for k in ms[0]}
        state = t.state_dict()
        errs.update({k: rel(state[k[6:]], v) for k, v in exp.items()
                     if k.startswith("state/") and k[6:] in state})
        worst = max(errs.values())
        out["golden"].append({"version": list(version), "bundle": name, "max_rel": worst,
                              "within_1e-5": worst <= 1e-5, "seconds": time.perf_counter() - t0})
        print(f"golden v{version[0]}.{version[1]} {name}: max rel {worst:.2e}", flush=True)

for name in ("linear_adamw", "dropout_sgd", "batchnorm_lr"):
    one, many = trainer(name), trainer(name, steps_per_call=4)
    b = golden_batches(name)
    m1, m4 = one.run(b, 11), many.run(b, 11)
    same = all(np.array_equal(np.asarray(x[k]), np.asarray(y[k])) for x, y in zip(m1, m4) for k in x)
    s1, s4 = one.state_dict(), many.state_dict()
    same_state = all(np.array_equal(s1[k], s4[k]) for k in s1)
    out["steps_per_call"].append({"bundle": name, "metrics_identical": same,
                                  "state_identical": same_state})
    print(f"steps_per_call=4 {name}: metrics identical {same}, state identical {same_state}")

for name in ("linear_adamw", "batchnorm_lr"):
    b = golden_batches(name)
    for k in (1, 8, 32):
        t = trainer(name, steps_per_call=k)
        n = 32 * 8
        t.run(b, 64, keep_metrics=False)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            last = t.run(b, n, keep_metrics=False)
            float(last[-1]["loss"])
            times.append((time.perf_counter() - t0) / n * 1e3)
        out["step_ms"].append({"bundle": name, "steps_per_call": k,
                               "median_ms": float(np.median(times)), "samples_ms": times})
        print(f"{name} steps_per_call={k}: {np.median(times):.4f} ms/step", flush=True)

json.dump(out, open(sys.argv[1], "w"), indent=1)
PY

# 3: the lean runtime tests, with what time is left (on the CPU; see the top).
left=$((deadline - SECONDS))
if [ "$left" -gt 60 ]; then
  timeout "$left" "$PY" -m pytest -q -p no:cacheprovider tests/runtime \
    -k "not hostile_soak and not fuzz" >"$OUT/pytest.txt" 2>&1 || echo "pytest: exit $? (see $OUT/pytest.txt)" >&2
  tail -3 "$OUT/pytest.txt" >&2
else
  echo "no time left for the runtime tests" >"$OUT/pytest.txt"
fi
rm -rf "$OUT/xla-cache"
echo "device_check: wrote $OUT" >&2
