#!/usr/bin/env bash
# mypy --strict over the whole package (src/ckptstore), then the Python scripts of
# scripts/stack/ (run from the image, not in the package) checked against it.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/mypy --config-file pyproject.toml -p ckptstore
exec .venv/bin/mypy --config-file pyproject.toml scripts/stack/*.py
