#!/usr/bin/env bash
# mypy --strict over the whole installed package. catalog/, tasks/, flows/ and migrations/ are
# mapped into ckptstore.* by setuptools, which mypy cannot see; so we lay out the package as it
# is installed (a tree of symlinks under build/) and check `-p ckptstore` there, then the
# Python scripts of scripts/stack/ against it.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree"
mkdir -p "$tree/ckptstore"
for f in src/ckptstore/*; do
  ln -s "../../../$f" "$tree/ckptstore/$(basename "$f")"
done
for d in catalog tasks flows migrations; do
  ln -s "../../../$d" "$tree/ckptstore/$d"
done
cd "$tree"
../../.venv/bin/mypy --config-file ../../pyproject.toml -p ckptstore
# The stack's Python entry points (scripts/stack/, run from the image, not in the package),
# checked against the package laid out here.
exec ../../.venv/bin/mypy --config-file ../../pyproject.toml ../../scripts/stack/*.py
