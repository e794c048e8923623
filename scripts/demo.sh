#!/usr/bin/env bash
# The main job: export the example training step once (torch_xla), then run the
# bundle in a separate lean process (no torch installed) and print its losses.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p build
echo "== export (torch + torch_xla, traced once) =="
.venv/bin/stepbundle export examples/linear_adamw.py:recipe -o build/linear.stepbundle
.venv/bin/python examples/make_data.py examples/linear_adamw.py:data build/linear-data.npz 16
echo "== run (lean process: jax $(.venv-lean/bin/python -c 'import jax; print(jax.__version__)'), no torch) =="
.venv-lean/bin/stepbundle run build/linear.stepbundle --steps 40 --data build/linear-data.npz \
  --save-state build/linear-final.safetensors
echo "== the same bundle, data-parallel over 2 devices (virtual CPU devices here; GPUs or TPUs with --device) =="
.venv-lean/bin/stepbundle run build/linear.stepbundle --steps 40 --data build/linear-data.npz --devices 2
