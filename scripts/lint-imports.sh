#!/usr/bin/env bash
# import-linter over the installed package (src/ckptstore, installed editable by make): the
# contracts are in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/lint-imports --no-cache "$@"
