#!/usr/bin/env bash
# The whole test suite: lint, types, every test in the export environment, the torch
# front-end's tests in its own environment (current torch, no torch_xla), then the schema
# and runtime tests again in the lean environment (newest jax, no torch).
# Extra arguments go to the first pytest run (e.g. -x, -k NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff =="
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy (strict on schema and runtime) =="
bash scripts/typecheck.sh
echo "== pytest (torch 2.9 + torch_xla + jax 0.7.1) =="
.venv/bin/python -m pytest -q "$@"
echo "== pytest, torch front-end (current torch + jax, no torch_xla) =="
.venv-torch/bin/python -m pytest -q tests/frontend_torch
echo "== pytest, lean environment (newest jax, no torch) =="
.venv-lean/bin/python -m pytest -q tests/schema tests/runtime
