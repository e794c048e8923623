#!/usr/bin/env bash
# Device check on an accelerator (a TPU through jax's TPU backend, or an NVIDIA GPU through
# jax's CUDA plugin), in under 10 minutes, never part of CI:
#
#   1. the golden bundles of every format version, on the device, against their expected
#      numbers, loaded with matmul_precision="highest" (a TPU's default runs float32
#      matmuls as bf16 passes; "highest" is what a comparison with the CPU needs), with
#      each bundle's compile time;
#   2. K steps per call are bit for bit K single steps on the device too (metrics and
#      state, steps_per_call 4 against 1, 11 steps);
#   3. step times of the golden bundles for steps_per_call 1, 8 and 32, and the host's
#      dispatch cost (what the automatic steps_per_call rule is built on);
#   4. with CNN_BUNDLE=... CNN_DATA=...npz, a CNN bundle's compile time per entry and 8
#      steps against the CPU (examples/cifar_cnn.py's train program once took a TPU 28x
#      its eval program's compile time; stablehlo/conv_wgrad.py);
#   5. (NVIDIA only, with the time left) the lean runtime tests on that machine's CPU.
#
# Writes RESULTS_DIR (default benchmarks/results/device/<device kind>/<UTC time>)/
# device_check.json. Needs jax with the device's backend in the interpreter (PYTHON=...,
# default .venv-lean/bin/python) and stepbundle importable; no torch.
#
#   bash scripts/device_check.sh            # PYTHON=... RESULTS_DIR=... to override
#   bash -n scripts/device_check.sh         # what CI may do: parse it, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv-lean/bin/python}
deadline=$((SECONDS + 570))

if command -v nvidia-smi >/dev/null 2>&1; then
  PLATFORM=cuda
else
  PLATFORM=tpu
fi
if ! KIND=$("$PY" -c "import jax, sys; d = jax.devices('$PLATFORM'); print(d[0].device_kind)" 2>/tmp/device_check_jax.err); then
  echo "device_check: jax sees no $PLATFORM device ($(tail -1 /tmp/device_check_jax.err)). On" \
    "an NVIDIA machine install jax's CUDA plugin ($PY -m pip install 'jax[cuda12]'); on a" \
    "TPU VM, jax with libtpu." >&2
  exit 3
fi
case "$KIND" in
  "TPU v5 lite"|"TPU v5e") SLUG=tpu-v5e ;;
  *) SLUG=$(echo "$KIND" | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9.-') ;;
esac
OUT=${RESULTS_DIR:-benchmarks/results/device/$SLUG/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
echo "device_check: $KIND ($PLATFORM), writing $OUT" >&2

STEPBUNDLE_CACHE_DIR=$(mktemp -d) timeout 420 "$PY" benchmarks/device/check.py \
  --platform "$PLATFORM" --out "$OUT/device_check.json" ${CNN_BUNDLE:+--cnn "$CNN_BUNDLE" "$CNN_DATA"}

left=$((deadline - SECONDS))
if [ "$PLATFORM" = cuda ] && [ "$left" -gt 60 ]; then
  # The tests load with device="cpu": this checks the lean runtime on that machine's jax.
  timeout "$left" "$PY" -m pytest -q -p no:cacheprovider tests/runtime \
    -k "not hostile_soak and not fuzz" >"$OUT/pytest.txt" 2>&1 || echo "pytest: exit $? (see $OUT/pytest.txt)" >&2
  tail -3 "$OUT/pytest.txt" >&2
fi
echo "device_check: wrote $OUT" >&2
