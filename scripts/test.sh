#!/usr/bin/env bash
# The whole test suite: lint, then types (mypy, at the start of lane 1: see below), then
#   1. the export environment (torch 2.9 + torch_xla + jax 0.7.1): every test but the
#      runtime's and the schema's own folders, which run in 4;
#   2. the runtime on jax 0.7.1, the oldest jax it supports: the tests where jaxlib's
#      version matters (compiling, serializing, donating, executing the golden bundles);
#   3. the torch front-end's tests in its own environment (current torch, no torch_xla),
#      with its half of tests/frontends (the tests both front-ends run);
#   4. tests/schema and tests/runtime, all of them, in the lean environment (newest jax,
#      no torch): where bundles run;
#   5. scripts/attacks.py in the lean environment: every attack of issue #29 (full disks,
#      hostile servers, SIGKILLs, ...) performed for real, about 2.5 minutes.
# Running all of tests/runtime under both jax versions would add ~8 minutes to CI for
# little: 2 covers what differs between jaxlib versions (runtime/_compat.py).
# Two lanes, as many as the CI machine's cores (most tests are one compile or one process
# at a time), balanced by their measured length: lane 1 runs stages 1 and 2 (both in
# .venv) and the files of stage 4 named in LEAN_IN_LANE_1 (lean environment, as in stage
# 4), lane 2 stages 3, the rest of 4, and 5. Each lane's output is printed whole when it ends.
# SERIAL=1 runs them one after another. CI runs the cache fuzz with 60 rounds (150 by
# default; STEPBUNDLE_CACHE_FUZZ_ROUNDS).
# Extra arguments go to the first pytest run (e.g. -x, -k NAME).
# Every pytest session compiles at XLA's LLVM -O0 (tests/conftest.py), except the sessions
# that hold tests of the product's default compile; scripts/attacks.py runs as a user's
# commands do, at the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff =="
.venv/bin/ruff check .
.venv/bin/ruff format --check .

# mypy takes ~100 s of processor time (ruff about half a second): it runs at the start of
# lane 1, beside lane 2's tests, instead of before both lanes. A type error does not stop
# the lane's tests; the lane's exit status carries it (typecheck_then).
typecheck_then() {  # typecheck_then FUNCTION ARGS...: mypy, then FUNCTION; fails if either did
  echo "== mypy (strict on schema and runtime) =="
  local rc_mypy=0
  bash scripts/typecheck.sh || rc_mypy=$?
  "$@"
  if [ "$rc_mypy" != 0 ]; then
    echo "== mypy failed (exit $rc_mypy): see its output at the top of this lane ==" >&2
    return "$rc_mypy"
  fi
}

# Stage 4's files that lane 1 runs after stage 2: lane 2 was the longer (2256 s against
# 2035 s in the last full local run, and most tests added since run in lane 2).
# test_cpu_numerics.py and test_layouts.py must stay out of lane 2's lean session: a
# session that collects either compiles at the product's defaults throughout
# (tests/conftest.py's DEFAULT_COMPILE).
LEAN_IN_LANE_1=(tests/runtime/test_offline.py tests/runtime/test_cpu_numerics.py
  tests/runtime/test_layouts.py)

lane_a() {
  echo "== pytest (torch 2.9 + torch_xla + jax 0.7.1) =="
  .venv/bin/python -m pytest -q --durations=10 --ignore=tests/runtime --ignore=tests/schema "$@"
  echo "== pytest, the runtime on jax 0.7.1 (the oldest jax the runtime supports) =="
  .venv/bin/python -m pytest -q --durations=5 tests/runtime/test_runtime_golden.py \
    tests/runtime/test_runtime_step.py tests/runtime/test_cache_integrity.py \
    tests/runtime/test_steps_per_call.py tests/runtime/test_data_parallel.py \
    tests/runtime/test_attention_composite.py \
    -k "not fuzzed"  # the cache fuzz (2.5 minutes) runs in the lean stage
  # A session of their own: they assert what the product's default compile computes, so
  # their session runs without the tests' -O0 flag (tests/conftest.py's DEFAULT_COMPILE),
  # and the session above keeps it.
  .venv/bin/python -m pytest -q --durations=5 tests/runtime/test_cpu_numerics.py \
    tests/runtime/test_layouts.py
  echo "== pytest, lean environment (newest jax, no torch): stage 4's files run in lane 1 =="
  .venv-lean/bin/python -m pytest -q --durations=5 "${LEAN_IN_LANE_1[@]}"
}
lane_b() {
  echo "== pytest, torch front-end (current torch + jax, no torch_xla) =="
  .venv-torch/bin/python -m pytest -q --durations=5 tests/frontend_torch tests/frontends
  echo "== pytest, lean environment (newest jax, no torch) =="
  STEPBUNDLE_CACHE_FUZZ_ROUNDS=${STEPBUNDLE_CACHE_FUZZ_ROUNDS:-60} \
    .venv-lean/bin/python -m pytest -q --durations=10 tests/schema tests/runtime \
    "${LEAN_IN_LANE_1[@]/#/--ignore=}"
  echo "== attacks (issue #29's attacks performed for real, scripts/attacks.py) =="
  # One at a time: lane 1 has the other core, and several attacks race a deadline.
  .venv-lean/bin/python scripts/attacks.py --jobs 1
}

if [ "${SERIAL:-0}" = 1 ]; then
  typecheck_then lane_a "$@"
  lane_b
  exit 0
fi
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
start=$SECONDS
(typecheck_then lane_a "$@") >"$logs/a" 2>&1 &
pid_a=$!
(set -e; lane_b) >"$logs/b" 2>&1 &
pid_b=$!
rc_a=0; wait "$pid_a" || rc_a=$?
cat "$logs/a"
echo "== lane 1 (mypy, stages 1-2) ended: exit $rc_a, $((SECONDS - start)) s =="
rc_b=0; wait "$pid_b" || rc_b=$?
cat "$logs/b"
echo "== lane 2 (stages 3-5) ended: exit $rc_b, $((SECONDS - start)) s =="
if [ "$rc_a" != 0 ] || [ "$rc_b" != 0 ]; then
  echo "FAILED: lane 1 exit $rc_a, lane 2 exit $rc_b" >&2
  exit 1
fi
