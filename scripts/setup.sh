#!/usr/bin/env bash
# Create the three environments this project uses, from nothing, idempotently:
#   .venv       exporter + tests: torch 2.9.0, torch_xla 2.9.0, jax 0.7.1 (pinned)
#   .venv-torch the torch front-end: current torch and jax 0.10.2, no torch_xla
#   .venv-lean  runtime only: the newest jax/jaxlib the index offers, and no torch at all
# Re-running is cheap: an environment is rebuilt only when pyproject.toml changed.
# The three are built at once, each logging to its own file, shown only if it fails.
# They are built with uv (PyPI's `uv`: parallel downloads and unpacking, one shared cache),
# found on PATH or installed once into build/uv from PyPI with the interpreter's own pip;
# UV=/path/to/uv picks another. uv reads no pip.conf: UV_DEFAULT_INDEX, UV_INDEX,
# UV_FIND_LINKS and the like configure it. `uv venv --seed` puts pip and setuptools in each
# environment as `python -m venv` did (torch.compile's C++ builder imports setuptools).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=$(sha256sum pyproject.toml | cut -c1-16)

if [ -z "${UV:-}" ]; then
  UV=$(command -v uv || true)
fi
if [ -z "$UV" ]; then
  UV=build/uv/bin/uv
  if ! [ -x "$UV" ]; then
    echo "[setup] installing uv into build/uv" >&2
    rm -rf build/uv
    "$PY" -m venv build/uv
    build/uv/bin/python -m pip install -q 'uv>=0.8,<1'
  fi
fi

make_env() {  # make_env DIR SPEC
  local dir=$1 spec=$2
  # Found, not imported: a working tree whose code does not import right now (an edit
  # in progress) must not cost a rebuild of the environment.
  if [ -f "$dir/.stepbundle-$stamp" ] && "$dir/bin/python" -c \
    "import importlib.util, sys; sys.exit(importlib.util.find_spec('stepbundle') is None)" \
    2>/dev/null; then
    return 0
  fi
  echo "[setup] creating $dir ($spec)" >&2
  rm -rf "$dir"
  "$UV" venv -q --seed --python "$PY" "$dir"
  "$UV" pip install -q --python "$dir/bin/python" -e "$spec"
  touch "$dir/.stepbundle-$stamp"
}

logs=$(mktemp -d)
pids=()
names=(.venv .venv-torch .venv-lean)
specs=(".[export,test]" ".[export-torch,export-torch-test]" ".[lean-test]")
for i in 0 1 2; do
  make_env "${names[$i]}" "${specs[$i]}" >"$logs/$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in 0 1 2; do
  if ! wait "${pids[$i]}"; then
    echo "[setup] building ${names[$i]} failed; its log:" >&2
    cat "$logs/$i.log" >&2
    failed=1
  else
    grep '^\[setup\]' "$logs/$i.log" >&2 || true
  fi
done
rm -rf "$logs"
[ "$failed" = 0 ] || exit 1
# The torch front-end's environment must not have torch_xla: its tests prove it needs none.
if .venv-torch/bin/python -c "import torch_xla" 2>/dev/null; then
  echo "[setup] .venv-torch has torch_xla installed; it must not" >&2
  exit 1
fi
# The lean environment must never have torch: the runtime's promise depends on it.
if .venv-lean/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] .venv-lean has torch installed; it must not" >&2
  exit 1
fi
