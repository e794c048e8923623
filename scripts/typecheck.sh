#!/usr/bin/env bash
# mypy over the installed layout: strict on schema, stablehlo, runtime and the CLI;
# the exporter is checked too, with torch's own (partial) types.
#
# mypy cannot follow setuptools' package-dir mapping (an editable install resolves
# `stepbundle.*` through an import hook mypy does not run), so the installed layout is
# mirrored with one symlink per top-level folder under build/typecheck, made from the
# same mapping pyproject.toml declares. Remove this once mypy reads import hooks or the
# folders move under one package directory.
set -euo pipefail
cd "$(dirname "$0")/.."
t=build/typecheck/stepbundle
rm -rf build/typecheck && mkdir -p "$t"
for f in package/*; do ln -s "$PWD/$f" "$t/$(basename "$f")"; done
for pkg in schema stablehlo runtime exporter cli; do ln -s "$PWD/$pkg" "$t/$pkg"; done
ln -s "$PWD/frontend_torch" "$t/export_torch"
ln -s "$PWD/frontend_core" "$t/frontend"
cd build/typecheck
../../.venv/bin/mypy --config-file ../../pyproject.toml \
  -p stepbundle.schema -p stepbundle.stablehlo -p stepbundle.runtime -p stepbundle.cli
