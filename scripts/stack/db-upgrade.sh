#!/usr/bin/env bash
# One-shot: create or upgrade the catalog schema at CKPT_CATALOG_URL to the newest revision.
# Every other ckptstore service starts only after this exits 0 (docker-compose.yml), so no
# process ever opens a catalog whose schema is behind its code.
set -euo pipefail
exec ckpt db upgrade
