#!/usr/bin/env bash
# mypy over the installed layout, strict on every package: the face, schema, stablehlo,
# runtime, the CLI, the front-end core and the torch_xla front-end against .venv (torch 2.9,
# jax 0.7.1); the torch front-end, written for current torch and jax, against .venv-torch's
# packages (its imports of the other packages are followed but judged in the first run).
#
# mypy cannot follow setuptools' package-dir mapping (an editable install resolves
# `stepbundle.*` through an import hook mypy does not run), so the installed layout is
# mirrored with one symlink per top-level folder under build/typecheck, made from the
# same mapping pyproject.toml declares. Remove this once mypy reads import hooks or the
# folders move under one package directory.
set -euo pipefail
cd "$(dirname "$0")/.."
# TYPECHECK_DIR: where the mirror goes (default build/typecheck); give each concurrent run its own.
d=${TYPECHECK_DIR:-build/typecheck}
t=$d/stepbundle
rm -rf "$d" && mkdir -p "$t"
for f in package/*; do ln -s "$PWD/$f" "$t/$(basename "$f")"; done
for pkg in schema stablehlo runtime exporter cli; do ln -s "$PWD/$pkg" "$t/$pkg"; done
ln -s "$PWD/frontend_torch" "$t/export_torch"
ln -s "$PWD/frontend_core" "$t/frontend"
root=$PWD
cd "$d"
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" -m stepbundle -m stepbundle._version \
  -p stepbundle.schema -p stepbundle.stablehlo -p stepbundle.runtime -p stepbundle.cli \
  -p stepbundle.frontend -p stepbundle.exporter
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --follow-imports=silent \
  --python-executable "$root/.venv-torch/bin/python" -p stepbundle.export_torch
