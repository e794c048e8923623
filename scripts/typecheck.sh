#!/usr/bin/env bash
# mypy, strict on stepbundle.schema and stepbundle.runtime. mypy cannot follow
# setuptools' package-dir mapping of an editable install, so the installed layout is
# mirrored with symlinks under build/typecheck and checked from there.
set -euo pipefail
cd "$(dirname "$0")/.."
t=build/typecheck/stepbundle
rm -rf build/typecheck && mkdir -p "$t"
ln -s "$PWD/stepbundle/__init__.py" "$t/__init__.py"
for pkg in schema runtime exporter; do ln -s "$PWD/$pkg" "$t/$pkg"; done
cd build/typecheck
../../.venv/bin/mypy --config-file ../../pyproject.toml -p stepbundle.schema -p stepbundle.runtime
