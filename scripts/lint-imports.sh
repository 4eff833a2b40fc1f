#!/usr/bin/env bash
# import-linter over the package as it is installed. catalog/, tasks/, flows/ and migrations/
# are mapped into ckptstore.* by setuptools, which import-linter cannot see from the source
# tree; so we lay the package out as installed (symlinks under build/) and check it there.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/importlint
rm -rf "$tree"
mkdir -p "$tree/ckptstore"
for f in src/ckptstore/*; do
  ln -s "../../../$f" "$tree/ckptstore/$(basename "$f")"
done
for d in catalog tasks flows migrations; do
  ln -s "../../../$d" "$tree/ckptstore/$d"
done
cd "$tree"
exec ../../.venv/bin/lint-imports ../../pyproject.toml --no-cache "$@"
